"""bench-vllm's summary over rounds and its verdict on issue 15's TTFT target
(pure functions of benchmarks.vllm; no vLLM needed)."""

from benchmarks.vllm import behind_router, medians, summarize, summary_table, table, target


def _run(connector: str, rnd: int, ttfts: list[float], tokens: list[list[int]], warm_up=(1, 2)) -> dict:
    return {"connector": connector, "round": rnd, "load_1m": [1.25, 2.0], "warm_up_tokens": list(warm_up),
            "results": [{"tokens": t, "ttft_s": x, "total_s": x + 0.1} for x, t in zip(ttfts, tokens)],
            "external_tokens": 7, "local_tokens": 0}


REF = [[1, 2], [3, 4], [5, 6]]
PROMPTS = [[9] * 3, [9] * 2, [9] * 2]


def _rows(spec: dict[str, list[list[float]]], wrong: tuple[str, int] | None = None,
          wrong_warm_up: tuple[str, int] | None = None) -> list[dict]:
    rows = []
    for connector, rounds in spec.items():
        for rnd, ttfts in enumerate(rounds, 1):
            tokens = [list(t) for t in REF]
            if wrong == (connector, rnd):
                tokens[1] = [0, 0]
            warm_up = (1, 0) if wrong_warm_up == (connector, rnd) else (1, 2)  # REF[0][:2] is right
            rows.append(summarize(_run(connector, rnd, ttfts, tokens, warm_up), REF, PROMPTS))
    return rows


def test_medians_take_each_connectors_rounds():
    rows = _rows({"kvferry": [[0.1, 0.2, 0.3], [0.5, 0.6, 0.7], [0.2, 0.3, 0.9]],
                  "mooncake": [[0.3, 0.4, 0.5], [0.1, 0.1, 0.1], [0.4, 0.4, 0.4]]}, wrong=("mooncake", 2))
    summary = {m["connector"]: m for m in medians(rows)}
    assert summary["kvferry"]["rounds"] == 3
    assert summary["kvferry"]["ttft_p50_s"] == 0.3  # round p50s 0.2, 0.6, 0.3
    assert summary["kvferry"]["ttft_p99_s"] == 0.7  # round p99s 0.3, 0.7, 0.9
    assert summary["mooncake"]["ttft_p50_s"] == 0.4  # round p50s 0.4, 0.1, 0.4
    assert summary["kvferry"]["tokens_equal_every_round"]
    assert not summary["mooncake"]["tokens_equal_every_round"]
    assert rows[0]["round"] == 1 and rows[2]["round"] == 3 and rows[0]["prompt_tokens"] == 7


def test_target_compares_kvferrys_faster_protocol_with_the_best_of_vllms_own():
    rows = _rows({"single": [[0.01, 0.01, 0.01]], "kvferry": [[0.5, 0.5, 0.5]],
                  "kvferry-concurrent": [[0.2, 0.2, 0.2]], "nixl": [[0.9, 0.9, 0.9]],
                  "mooncake": [[0.25, 0.25, 0.25]]})
    verdict = target(medians(rows))
    assert (verdict["kvferry"], verdict["best_vllm"], verdict["met"]) == ("kvferry-concurrent", "mooncake", True)
    rows = _rows({"kvferry": [[0.5, 0.5, 0.5]], "nixl-tuned": [[0.3, 0.3, 0.3]], "mooncake": [[0.4, 0.4, 0.4]]})
    verdict = target(medians(rows))
    assert (verdict["kvferry"], verdict["best_vllm"], verdict["met"]) == ("kvferry", "nixl-tuned", False)
    assert "NOT MET" in summary_table(medians(rows), verdict)
    assert target(medians(_rows({"kvferry": [[0.1, 0.1, 0.1]]}))) is None


def test_table_rows_name_round_and_load():
    rows = _rows({"kvferry": [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]}, wrong=("kvferry", 2))
    lines = table(rows).splitlines()
    assert lines[2].startswith("| kvferry | 1 | 1.2-2.0 | 3 | 0.200 |") and "| 3/3 |" in lines[2]
    assert lines[3].startswith("| kvferry | 2 |") and "| 2/3 |" in lines[3]


def test_a_wrong_warm_up_marks_the_round_and_the_connector():
    rows = _rows({"kvferry": [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]}, wrong_warm_up=("kvferry", 2))
    assert [r["warm_up_equal"] for r in rows] == [True, False]
    lines = table(rows).splitlines()
    assert "| 3/3 | yes |" in lines[2] and "| 3/3 | NO |" in lines[3]
    assert not medians(rows)[0]["tokens_equal_every_round"]


def test_behind_router_sets_kvferry_beside_the_in_tree_connector_of_each_mode():
    rows = _rows({"kvferry@vllm-router-nixl": [[0.2, 0.2, 0.2]], "nixl@vllm-router-nixl": [[0.8, 0.8, 0.8]],
                  "kvferry@vllm-router-mooncake": [[0.3, 0.3, 0.3]]})
    routed = behind_router(medians(rows))
    assert [(r["mode"], r["theirs"], r["kvferry_p50_s"], r["theirs_p50_s"]) for r in routed] == \
        [("nixl", "nixl", 0.2, 0.8)]  # mooncake mode: no in-tree row, no comparison
    assert routed[0]["ratio"] == 0.25
    assert "Behind vllm-router `--kv-connector nixl`" in summary_table(medians(rows), None, None, routed)
