"""kvferry's benchmark: ``python -m benchmarks`` (see :mod:`benchmarks.cli`).

Not part of the installed library: it lives beside it in the repository, as
do the tests, and uses the shared process harness (:mod:`harness`).
"""
