"""PD retract rebootstrap through kvferry (``make test-sglang``).

SGLang's decode, after ``pause_generation(mode="retract")`` and
``continue_generation``, makes a new receiver for each retracted request's
room and calls ``kv_manager.submit_prefill_recompute(receiver, payload)``:
the prefill server is asked, by ``POST /generate``, to recompute the room
and send its KV again. Here prefill TP 1 and decode TP 2 follow SGLang's call
sequence (``rebootstrap.py``); the prefill rank serves a stand-in
``/generate`` on the HTTP port its manager registered.
"""

from __future__ import annotations

import pytest

from harness.ports import free_port
from tests.engines.sglang.procs import Run
from tests.engines.sglang.scenarios import requests_of

pytestmark = pytest.mark.e2e

#: decode's bound on a rebootstrap's POST /generate in this test (SGLang's waiting timeout otherwise)
RECOMPUTE_TIMEOUT_S = 3.0
#: how long a submit may take: it only queues the POST (the silent room's takes RECOMPUTE_TIMEOUT_S)
SUBMIT_BOUND_S = 0.2
#: from the submit to the room's Failed poll, for a failure known at once (the abort reaches prefill and back)
FAST_FAIL_BOUND_S = 5.0


def _by_room(events: list[dict], generation: int) -> dict[int, dict]:
    return {e["room"]: e for e in events if e.get("generation") == generation}


def test_a_retracted_room_is_recomputed_by_prefill_and_every_failure_fails_it_in_bound():
    """(a) Only decode's attention TP leader posts, once per room, SGLang's own
    payload to the URL built from the HTTP port prefill registered; the
    recomputed room lands byte-exact on both decode ranks. (b) No registered
    port, an HTTP 503 and a /generate that never answers each fail the room on
    the leader with a PrefillRecomputeError (the timeout: PrefillRecomputeTimeout)
    naming the rid, the room and the URL, within a bound; the other rank fails
    with it (SGLang's MIN over the ranks). (c) Every submit returns at once."""
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    with Run("rebootstrap", pool="mha", prefill_tp=1, decode_tp=2, timeout_s=150,
             extra_args=["--http-port", str(http_port), "--recompute-timeout", str(RECOMPUTE_TIMEOUT_S)],
             env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}) as run:
        run.finish()
        assert all(not p.events("DONE")[0]["timed_out"] for p in run.prefill + run.decode)
        (prefill,) = run.prefill
        leader, other = run.decode
        for d in run.decode:  # the URL from what prefill registered (its ServerArgs.port) and the bootstrap host
            ready = d.events("READY")[0]
            assert (ready["prefill_http_port"], ready["prefill_url"]) == (http_port, url), ready
        reqs = {r.action: r for r in requests_of("rebootstrap")}

        # every room landed once before the retraction
        for d in run.decode:
            first = _by_room(d.events("RESULT"), 1)
            assert all(first[r.room]["state"] == "Success" and first[r.room]["bad_page_bytes"] == 0
                       for r in reqs.values()), first

        # (c) the scheduler never waits on HTTP: each submit only queues, on the leader and the other rank
        submits = {(e["attn_tp_rank"], e["room"]): e for d in run.decode for e in d.events("SUBMIT")}
        assert len(submits) == 2 * len(reqs)
        assert all(e["seconds"] < SUBMIT_BOUND_S for e in submits.values()), submits

        # (a) one POST per room, from the leader only, SGLang's payload as the leader built it
        posts = prefill.events("GENERATE")
        posted = sorted(e["room"] for e in posts)
        assert posted == sorted(r.room for a, r in reqs.items() if a != "rebootstrap_unresolved"), posts
        for e in posts:
            assert e["path"] == "/generate"
            assert e["body"] == submits[(0, e["room"])]["payload"], e
            assert e["body"]["bootstrap_room"] == e["room"] and e["body"]["rid"] == f"rid-{e['room']}"
            assert e["body"]["sampling_params"]["max_new_tokens"] == 1
            assert e["body"]["input_ids"] == list(range(100, 120)) + [7, 8, 9]
        assert prefill.events("DONE")[0]["posts"] == len(posts)

        again = reqs["rebootstrap"].room
        for d in run.decode:
            got = _by_room(d.events("RESULT"), 2)[again]
            assert got["state"] == "Success", got
            assert got["bad_page_bytes"] == got["bad_aux_bytes"] == 0 and got["page_bytes_checked"] > 0, got
        assert _by_room(prefill.events("RESULT"), 2)[again]["state"] == "Success"

        # (b) each failure on the leader: typed, saying what and where, within its bound
        second = _by_room(leader.events("RESULT"), 2)
        cases = {"rebootstrap_http_error": ("PrefillRecomputeError", "answered HTTP 503", f"POST {url}/generate"),
                 "rebootstrap_unresolved": ("PrefillRecomputeError", "registered no HTTP port",
                                            "the prefill server at 127.0.0.1:"),
                 "rebootstrap_silent": ("PrefillRecomputeTimeout", f"not answered within {RECOMPUTE_TIMEOUT_S:g} s",
                                        f"POST {url}/generate")}
        for action, (kind, what, where) in cases.items():
            room = reqs[action].room
            got = second[room]
            assert got["state"] == "Failed", got
            assert got["error"].startswith(kind + ":"), got
            assert what in got["error"] and where in got["error"], got
            assert f"PD retract rebootstrap of rid rid-{room} (room {room}): " in got["error"], got
            low, high = (RECOMPUTE_TIMEOUT_S, RECOMPUTE_TIMEOUT_S + FAST_FAIL_BOUND_S) \
                if action == "rebootstrap_silent" else (0.0, FAST_FAIL_BOUND_S)
            assert low <= got["after_s"] < high, (action, got)
            theirs = _by_room(other.events("RESULT"), 2)[room]
            assert theirs["state"] == "Failed" and ("failed on another rank" in theirs["error"] or
                                                    kind in theirs["error"]), theirs
        assert not [e for e in prefill.events("RESULT") if e["generation"] == 2 and e["room"] != again]
