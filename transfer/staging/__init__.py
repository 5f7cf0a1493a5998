"""The staged path: scattered pages gathered into a registered staging buffer,
written as a few large descriptors, scattered on the other side.

- :mod:`~transfer.staging.area`: the staging memory and its region allocator;
- :mod:`~transfer.staging.copies`: ``gather`` and ``scatter`` (torch index ops);
- :mod:`~transfer.staging.prefill_flow`, :mod:`~transfer.staging.decode_flow`:
  the message flow of staged parts on each side.

``transfer.staging.StagingArea``, ``gather``, ``scatter`` and ``staged_bytes``
keep the names the module ``transfer/staging.py`` had.
"""

from bootstrap.lazy import lazy_exports

_EXPORTS = {
    "StagingArea": "transfer.staging.area", "StagingMemory": "transfer.staging.area",
    "gather": "transfer.staging.copies", "scatter": "transfer.staging.copies",
    "staged_bytes": "transfer.staging.copies",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
