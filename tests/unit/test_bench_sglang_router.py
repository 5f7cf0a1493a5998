"""The SGLang router benchmark's summary (pure functions of
benchmarks.sglang_router; no SGLang needed)."""

from benchmarks.sglang_router import summarize, table, verdict


def _run(row: str, rnd: int, ttfts: list[float], tokens: list[list[int]], warm_up=(7, 8)) -> dict:
    return {"row": row, "round": rnd, "load_1m": [0.5, 1.0], "warm_up_tokens": list(warm_up),
            "results": [{"tokens": t, "ttft_s": x, "total_s": x + 0.2} for x, t in zip(ttfts, tokens)]}


REF = _run("single", 1, [0.1, 0.1, 0.1], [[1, 2], [3, 4], [5, 6]], warm_up=(7, 8, 9))


def test_rows_compare_tokens_and_the_warm_up_with_the_single_servers_run():
    good = summarize(_run("kvferry@sglang-router", 1, [0.3, 0.2, 0.4], [[1, 2], [3, 4], [5, 6]]), REF)
    bad = summarize(_run("mooncake@sglang-router", 1, [0.5, 0.5, 0.5], [[1, 2], [0, 0], [5, 6]], (7, 0)), REF)
    assert (good["tokens_equal"], good["warm_up_equal"], good["ttft_p50_s"]) == (3, True, 0.3)
    assert (bad["tokens_equal"], bad["warm_up_equal"]) == (2, False)
    lines = table([summarize(REF, REF), good, bad]).splitlines()
    assert "| 3/3 (reference: round 1) | - |" in lines[2]
    assert "| 3/3 | yes |" in lines[3] and "| 2/3 | NO |" in lines[4]
    alone = summarize(_run("kvferry@sglang-router", 1, [0.3], [[1, 2]]), None)
    assert (alone["tokens_equal"], alone["warm_up_equal"]) == (0, False)  # no reference: nothing counts as equal


def test_the_verdict_sets_kvferry_beside_sglangs_mooncake_backend():
    rows = [summarize(_run("kvferry@sglang-router", r, [p] * 3, [[1, 2], [3, 4], [5, 6]]), REF)
            for r, p in ((1, 0.2), (2, 0.4), (3, 0.3))]
    rows += [summarize(_run("mooncake@sglang-router", 1, [0.6] * 3, [[1, 2], [3, 4], [5, 6]]), REF)]
    text = verdict(rows)
    assert "kvferry 0.300 s, SGLang's mooncake backend 0.600 s (0.50x)" in text
    assert "did not run" in verdict(rows[:3])
