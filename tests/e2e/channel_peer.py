"""A process holding one kvferry zmq control channel, for the channel tests.

``python -m tests.e2e.channel_peer --heartbeat-s H --timeout-s T`` prints
``READY <endpoint>``, then answers stdin lines: ``hold S`` holds the
interpreter lock for S seconds in a C call (libc's ``usleep`` through
``ctypes.PyDLL``, which keeps the lock: no Python thread of this process
runs, libzmq's I/O threads do) and prints ``HELD``; ``exit`` exits.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

from transfer.control.base import ChannelOptions
from transfer.control.zmq_channel import ZmqChannel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heartbeat-s", type=float, required=True)
    ap.add_argument("--timeout-s", type=float, required=True)
    a = ap.parse_args()
    options = ChannelOptions(host="127.0.0.1", heartbeat_interval_s=a.heartbeat_s, peer_timeout_s=a.timeout_s)
    channel = ZmqChannel(options, lambda msg, origin: None)
    print(f"READY {channel.endpoint}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["hold"]:
            ctypes.PyDLL(None).usleep(int(float(cmd[1]) * 1e6))
            print("HELD", flush=True)
        elif cmd[:1] == ["exit"]:
            break
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
