"""The NIXL transport in `make test` (the whole multi-process suite runs on
it in `make test-nixl`): one byte-exact run with prefill and decode on NIXL
(UCX, loopback), and a transport mismatch refused by name on both sides."""

import time

import pytest

from harness.launch import BootstrapProcess, collect, results_of, run_pd, start_ranks
from harness.workload import PoolSpec, Spec
from transfer.storage.nixl.probe import nixl_missing_reason

from tests.e2e.conftest import assert_all_succeeded, e2e_transport

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(nixl_missing_reason()), reason=nixl_missing_reason())]

MHA = PoolSpec(num_layers=4, total_heads=8, head_dim=128, dtype="bfloat16")


def test_rooms_land_byte_exact_on_nixl(monkeypatch):
    monkeypatch.setenv("KVFERRY_TEST_TRANSPORT", "nixl")
    spec = Spec(bootstrap="", prefill_pools=(MHA,), decode_pools=(MHA,), num_rooms=6, concurrency=3,
                chunk_pages=7, min_tokens=100, max_tokens=2048, page_placement="scattered", seed=18)
    runs = run_pd(spec, timeout_s=120)
    assert_all_succeeded(runs, 6)  # also: every rank says it ran on nixl


@pytest.mark.parametrize("prefill,decode", [
    ("nixl", "mooncake"),
    pytest.param("mooncake", "nixl", marks=pytest.mark.skipif(
        e2e_transport() != "nixl", reason="the other direction runs in make test-nixl (make test's time budget)")),
])
def test_a_transport_mismatch_is_refused_by_name_on_both_sides(prefill, decode):
    with BootstrapProcess() as server:
        spec = Spec(bootstrap=server.address, prefill_pools=(MHA,), decode_pools=(MHA,), num_rooms=2,
                    concurrency=2, max_tokens=256, timeout_s=20)
        deadline = time.monotonic() + 60
        procs = [(role, *start_ranks(spec, role, ["--tp-rank", "0"], env={"KVFERRY_BACKEND": backend}))
                 for role, backend in (("prefill", prefill), ("decode", decode))]
        runs = {role: results_of(collect(proc, out, deadline), role, proc.returncode)[0] for role, proc, out in procs}
    for role, run in runs.items():
        assert run.result is not None, run.log[-2000:]
        assert run.result["success"] == 0 and len(run.result["failed"]) == 2, run.result
        for _room, why in run.result["failed"]:
            assert "incompatible transport" in why, (role, why)
    why = runs["decode"].result["failed"][0][1]
    assert why.startswith("IncompatibleTransportError"), why
    assert f"prefill rank prefill dp 0 tp 0/1 uses transport {prefill}, this decode rank uses {decode}" in why, why
    assert f"uses transport {decode}, this prefill rank uses {prefill}" in runs["prefill"].log, \
        runs["prefill"].log[-2000:]
