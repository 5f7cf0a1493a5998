"""One request's KV from a prefill to a decode KVManager on one host (CPU
tensors, TCP), in two chunks, checked byte for byte: python -m examples.one_host"""

from concurrent.futures import ThreadPoolExecutor

import torch

from bootstrap.server import BootstrapServer
from transfer import EngineConfig, KVManager, KVPoll, KVReceiver, KVSender, ManagerConfig, MHAPool, Role

LAYERS, SHAPE = 4, (64, 16, 8, 64)  # per layer a K and a V [num_pages, page_size, kv_heads, head_dim]
ROOM, DONE = 7, (KVPoll.Success, KVPoll.Failed)


def manager(role, bootstrap, kv, aux):
    config = ManagerConfig(role=role, bootstrap_addr=bootstrap, engine=EngineConfig(protocol="tcp"))
    return KVManager(config, [MHAPool(k=kv[:LAYERS], v=kv[LAYERS:], total_kv_heads=SHAPE[2])], aux=aux)


def prefill_loop(mgr, bootstrap, pages, aux_slot):
    sender = KVSender(mgr, bootstrap, ROOM)
    chunks, seen = [pages[:6], pages[6:]], mgr.progress  # chunked prefill: two chunks of pages
    while (state := sender.poll()) not in DONE:
        if state == KVPoll.WaitingForInput:  # every decode rank asked for this room
            sender.init(num_pages=len(pages), aux_index=aux_slot)
        if state in (KVPoll.WaitingForInput, KVPoll.Transferring) and chunks:
            chunk = chunks.pop(0)
            # CUDA pools written on another stream: pass ready=<torch.cuda.Event recorded after the write>
            sender.send(chunk, last=not chunks)  # the last chunk also sends the aux row
        seen = mgr.wait_for_progress(seen, timeout_s=0.05)  # a forward pass would run here
    sender.failure_exception()  # raises why, if the room failed


def decode_loop(mgr, bootstrap, pages, aux_slot):
    receiver = KVReceiver(mgr, bootstrap, ROOM)
    receiver.init(pages, aux_index=aux_slot)  # may come before bootstrapping is done
    mark = mgr.progress
    while receiver.poll() not in DONE:
        mgr.wait_for_progress(mark, timeout_s=1.0)
        # Which rooms moved since the mark, and to what (None: fell behind, poll them all):
        # a scheduler with thousands of live rooms polls only these.
        mark, changed = mgr.changed_rooms(mark)
        for room, state in changed or []:
            print(f"decode room {room.room}: {state.name}")
    receiver.failure_exception()


def main():
    gen = torch.Generator().manual_seed(2026)
    src = [torch.randint(-2**15, 2**15, SHAPE, dtype=torch.int16, generator=gen).view(torch.bfloat16)
           for _ in range(2 * LAYERS)]  # random bits
    dst = [torch.zeros_like(t) for t in src]
    src_aux = torch.randint(0, 256, (4, 64), dtype=torch.uint8, generator=gen)  # one metadata row per slot
    dst_aux = torch.zeros(8, 64, dtype=torch.uint8)
    src_pages, dst_pages = (torch.randperm(SHAPE[0], generator=gen)[:10].tolist() for _ in range(2))
    server = BootstrapServer("127.0.0.1", 0).start()  # or: python -m bootstrap --port 8998
    try:
        with manager(Role.PREFILL, server.address, src, src_aux) as prefill, \
                manager(Role.DECODE, server.address, dst, dst_aux) as decode, ThreadPoolExecutor(1) as pool:
            prefill_done = pool.submit(prefill_loop, prefill, server.address, src_pages, 1)
            decode_loop(decode, server.address, dst_pages, 5)
            prefill_done.result()
    finally:
        server.close()
    same = all(torch.equal(s[src_pages].view(torch.int16), d[dst_pages].view(torch.int16)) for s, d in zip(src, dst))
    if not (same and torch.equal(src_aux[1], dst_aux[5])):
        raise SystemExit("FAILED: the decode pages or aux row differ from the prefill's")
    print(f"OK: {len(dst_pages)} pages x {2 * LAYERS} buffers and the aux row arrived byte for byte")


if __name__ == "__main__":
    main()
