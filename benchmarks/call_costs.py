"""``python -m benchmarks.call_costs``: the per-call costs docs/scale.md's
model uses: one ``transfer_submit_write`` of 4 KiB and one
``transfer_check_status`` (two Mooncake engines in one process, TCP
loopback), and encoding / decoding a 64-page TransferRequest."""

import json
import os
import sys
import time
import timeit

import numpy as np

from bootstrap import codec
from bootstrap.messages import PoolRole
from transfer.config import EngineConfig
from transfer.transport.mooncake.process import apply_mooncake_env
from transfer.messages import PoolAssignment, TransferRequest


def main() -> None:
    apply_mooncake_env(EngineConfig(protocol="tcp", log_level="ERROR"))
    from mooncake.engine import TransferEngine
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("Mooncake initialize failed")
    peer = f"127.0.0.1:{b.get_rpc_port()}"
    n = 1000
    src, dst = np.zeros(n * 4096, np.uint8), np.zeros(n * 4096, np.uint8)
    b.register_memory(dst.ctypes.data, dst.nbytes)
    t0 = time.perf_counter()
    ids = [a.transfer_submit_write(peer, src.ctypes.data + i * 4096, dst.ctypes.data + i * 4096, 4096)
           for i in range(n)]
    submit_us = (time.perf_counter() - t0) / n * 1e6
    time.sleep(1.0)
    t0 = time.perf_counter()
    status = [a.transfer_check_status(t) for t in ids]
    check_us = (time.perf_counter() - t0) / n * 1e6
    req = TransferRequest(room=1, request_id=3, decode_session="127.0.0.1:1234",
                          decode_endpoint="tcp://127.0.0.1:5555", decode_tp_rank=0,
                          dst_pages=np.arange(64, dtype="<i4").tobytes(), dst_aux_index=1,
                          assignments=(PoolAssignment(role=PoolRole.TARGET, send=True, src_head_offset=0,
                                                      dst_head_offset=0, num_heads=8),),
                          num_requests=1, skip_pages=0)
    wire = codec.encode(req)
    enc = min(timeit.repeat(lambda: codec.encode(req), number=2000, repeat=3)) / 2000 * 1e6
    dec = min(timeit.repeat(lambda: codec.decode(wire), number=2000, repeat=3)) / 2000 * 1e6
    print(json.dumps(dict(submit_us=round(submit_us, 2), check_status_us=round(check_us, 2),
                          writes_done=sum(s == 1 for s in status), transfer_request_bytes=len(wire),
                          encode_us=round(enc, 1), decode_us=round(dec, 1))))
    sys.stdout.flush()
    os._exit(0)  # skip the engines' slow destructors


if __name__ == "__main__":
    main()
