"""benchmarks.syscalls: the strace parser counts only the data phase, and
socket bytes by direction from the calls' return values."""

import pytest

from benchmarks.syscalls import _parse

TRACE = """\
100 10:00:00.000001 openat(AT_FDCWD</>, "/usr/lib/x.so", O_RDONLY) = 3</usr/lib/x.so>
100 10:00:00.100000 sendto(7<TCP:[127.0.0.1:1->127.0.0.1:2]>, "..."..., 65536, 0, NULL, 0) = 65536
101 10:00:00.100500 epoll_wait(9<anon_inode:[eventpoll]>,  <unfinished ...>
100 10:00:00.101000 sendto(7<TCP:[127.0.0.1:1->127.0.0.1:2]>, "..."..., 65536, 0, NULL, 0) = 40000
101 10:00:00.101500 <... epoll_wait resumed>[{events=EPOLLIN}], 64, 10) = 1
101 10:00:00.102000 recvfrom(8<TCP:[127.0.0.1:2->127.0.0.1:1]>, "k", 8, 0, NULL, NULL) = 8
100 10:00:00.103000 read(3</usr/lib/x.so>, "..."..., 70000) = 70000
100 10:00:00.200000 sendto(7<TCP:[127.0.0.1:1->127.0.0.1:2]>, "..."..., 131072, 0, NULL, 0) = 131072
100 10:00:01.000000 close(3</usr/lib/x.so>) = 0
"""


def test_the_data_phase_and_socket_bytes(tmp_path):
    path = tmp_path / "t"
    path.write_text(TRACE)
    side, t0, t1 = _parse(str(path), "sender")
    assert (t0, t1) == pytest.approx((36000.1, 36000.2))  # first to last socket call of >= 64 KiB
    assert side.sock_bytes == {"send": 65536 + 40000 + 131072, "recv": 8}
    assert side.sock_calls == {"send": 3, "recv": 1}
    # the file read inside the phase counts as a call, not as socket bytes; the
    # open before it and the close after it are outside the phase
    assert side.calls["read"] == 1 and "openat" not in side.calls and "close" not in side.calls
    assert side.calls["epoll_wait"] == 1 and side.threads == {"100", "101"}
