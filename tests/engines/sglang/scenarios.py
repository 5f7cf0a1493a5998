"""The requests both sides of a run agree on, by name (no other coordination)."""

from __future__ import annotations

from dataclasses import dataclass, field

PAGE_SIZE = 4
_BASE = 7_000_000_000_123  # SGLang's rooms are large random integers


@dataclass(frozen=True)
class Request:
    """``chunks``: page counts of the non-last chunks, the rest is the last
    chunk (possibly empty); ``prefix_pages``: leading pages decode holds."""

    room: int
    num_pages: int
    chunks: tuple[int, ...] = ()
    prefix_pages: int = 0
    action: str = ""  # "", "decode_abort" (every decode rank), "decode_abort_one" (its first TP rank),
    # "prefill_abort", "kill", "release", "early_event", "rebootstrap*" (see below)
    corrupt: bool = False  # decode flips a landed byte before it checks the KV checksum
    after_release: bool = False  # decode asks for it only after its memory release and resume
    tags: tuple[str, ...] = field(default=())


def requests_of(name: str) -> list[Request]:
    if name == "main":
        return [
            Request(_BASE + 1, 5, tags=("one chunk",)),
            Request(_BASE + 2, 7, (3, 3), tags=("chunked", "one-page last chunk")),
            Request(_BASE + 3, 6, (2, 1), tags=("chunked",)),
            Request(_BASE + 4, 6, (2,), prefix_pages=2, tags=("decode prefix",)),
            Request(_BASE + 5, 4, action="decode_abort", tags=("abort on decode",)),
            Request(_BASE + 6, 5, (2,), action="prefill_abort", tags=("abort on prefill",)),
            Request(_BASE + 7, 3, prefix_pages=3, tags=("decode holds every page", "empty last chunk")),
            Request(_BASE + 8, 5, (2,), action="decode_abort_one", tags=("abort on the first decode TP rank",)),
        ]
    if name == "checksum":  # --kv-checksum: SGLang's digest row travels with the aux rows
        return [
            Request(_BASE + 30, 5, tags=("one chunk",)),
            Request(_BASE + 31, 7, (3,), prefix_pages=2, tags=("chunked", "decode prefix")),
            Request(_BASE + 32, 6, (2,), corrupt=True, tags=("a page corrupted on decode",)),
        ]
    if name == "release":
        # Decode releases its KV memory (release_memory_occupation) while the first room is in flight
        # (prefill sent one chunk and holds the rest), resumes, then asks for the second room.
        return [
            Request(_BASE + 40, 6, (2,), action="release", tags=("in flight at the release",)),
            Request(_BASE + 41, 5, (2,), prefix_pages=1, after_release=True, tags=("after the resume",)),
        ]
    if name == "early":
        # SGLang's early send of a cached prefix under overlap scheduling: the first chunk's pages are still
        # being written (for 0.5 s) when send() comes, with the event that says when they are done.
        return [Request(_BASE + 50, 6, (2,), action="early_event", tags=("early send with a wait event",))]
    if name == "rebootstrap":
        # Every room lands, then decode retracts them all (pause_generation(mode="retract"), continue_generation)
        # and asks the prefill's /generate (the prefill rank's stand-in HTTP server) to recompute each
        # (rebootstrap_of): "rebootstrap" is recomputed and sent again; the stand-in answers HTTP 503 for
        # "rebootstrap_http_error", never answers for "rebootstrap_silent"; for "rebootstrap_unresolved" decode's
        # table lacks the prefill's HTTP port, as for a prefill that registered none.
        return [Request(_BASE + 60, 5, (2,), action="rebootstrap", tags=("recomputed by prefill",)),
                Request(_BASE + 61, 4, action="rebootstrap_http_error", tags=("prefill answers 503",)),
                Request(_BASE + 62, 4, action="rebootstrap_silent", tags=("prefill never answers",)),
                Request(_BASE + 63, 4, action="rebootstrap_unresolved", tags=("no prefill HTTP port known",))]
    if name == "kill":
        return [Request(_BASE + 20, 6, (2,), action="kill", tags=("killed prefill",))]
    if name.startswith("bench"):
        # bench-<kind>-<pages>-<count>: contiguous or scattered pages is the rank's choice
        _, _, pages, count = name.split("-")
        return [Request(_BASE + 100 + i, int(pages)) for i in range(int(count))]
    raise ValueError(f"unknown scenario {name!r}")


def rebootstrap_of(req: Request) -> Request:
    """A retracted request as prefill recomputes it: the same room, one page
    more (the outputs so far join the prompt), so its KV is another draw."""
    return Request(req.room, req.num_pages + 1, (2,), action=req.action, tags=req.tags + ("recomputed",))
