"""``make bench-hicache-server``'s pure parts (benchmarks.hicache_server): its
config's checks, the token check that fails a run, and the doc block."""

import pytest

from benchmarks.hicache_server import ROWS, HiCacheServerBenchConfig, check_tokens, doc_text


def _run(ttft: dict, tokens=(5, 6), storage=8192) -> dict:
    return {"ttft_s": ttft, "total_s": ttft + 0.1, "tokens": list(tokens), "storage_tokens": storage,
            "metric_storage_tokens": storage}


def _result(rounds: int = 2) -> dict:
    rows = [{"round": r, "load_1m": [1.0, 1.2], **{name: _run(t) for name, t in zip(ROWS, (4.0, 4.2, 1.2, 1.3 + r / 10))}}
            for r in range(1, rounds + 1)]
    return {"config": HiCacheServerBenchConfig(rounds=rounds).__dict__, "rounds": rows, "after_restart": _run(1.5)}


def test_the_config_refuses_what_cannot_run():
    assert HiCacheServerBenchConfig().hit_pages == 512  # 8193 tokens: 512 full pages, the last token computed
    for bad in ({"chunk_tokens": 100}, {"prompt_tokens": 16380}, {"rounds": 0}):
        with pytest.raises(ValueError):
            HiCacheServerBenchConfig(**bad)


def test_a_reply_whose_tokens_differ_fails_the_run():
    result = _result()
    check_tokens(result["rounds"], result["after_restart"])
    result["rounds"][1]["from L3"]["tokens"] = [5, 7]
    with pytest.raises(RuntimeError, match="round 2: from L3"):
        check_tokens(result["rounds"], result["after_restart"])
    result = _result()
    result["after_restart"]["tokens"] = [9]
    with pytest.raises(RuntimeError, match="after the restart"):
        check_tokens(result["rounds"], result["after_restart"])


def test_the_doc_block_has_every_round_the_medians_and_the_restart():
    text = doc_text(_result())
    assert "CPU figures" in text and "16 MiB of KV" in text
    assert "| 1 | 1.0-1.2 | 4.000 | 4.200 | 1.200 | 1.400 | +0.200 | 8192 / 8192 | yes |" in text
    assert "| median | | 4.000 | 4.200 | 1.200 | 1.450 | +0.250 | | |" in text
    assert "after a restart" in text and "TTFT 1.500 s" in text
