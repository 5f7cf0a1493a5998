"""The file store beyond the shared contract: damaged files, the size cap, atomic writes."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transfer.errors import StorageError
from transfer.storage import file as file_module
from transfer.storage.base import open_storage
from transfer.storage.file import FileStore, FileStoreConfig

HEADER_BYTES = 32


class Buffers:
    """Host buffers with known contents, as segments."""

    def __init__(self, *sizes: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.raw = [(ctypes.c_char * n).from_buffer_copy(rng.randbytes(n)) for n in sizes]

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(ctypes.addressof(b), len(b)) for b in self.raw]

    @property
    def value(self) -> bytes:
        return b"".join(b.raw for b in self.raw)


def store_at(tmp_path: Path, **options) -> FileStore:
    return open_storage(f"file://{tmp_path / 'store'}", **options)


def key_path(tmp_path: Path, key: str) -> Path:
    return tmp_path / "store" / key[:2] / key


def test_files_hold_a_header_and_the_payload(tmp_path):
    store = store_at(tmp_path)
    src = Buffers(100, 28, seed=1)
    assert store.put(["abc123"], [src.segments]) == [True]
    data = key_path(tmp_path, "abc123").read_bytes()
    assert len(data) == HEADER_BYTES + 128 and data[:8] == b"KVFERRY1" and data[HEADER_BYTES:] == src.value
    assert not [p for p in (tmp_path / "store").rglob(".*")], "no temporary file left behind"


def _from_another_boot(data: bytearray) -> None:
    """Make a file's header say another boot (or machine) wrote it."""
    data[24:32] = bytes(b ^ 0xFF for b in data[24:32])


@pytest.mark.parametrize("damage", ["flip a payload byte", "flip a payload byte (verify=always)", "flip a header byte",
                                    "truncate", "append", "empty"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    store = store_at(tmp_path, **({"verify": "always"} if "always" in damage else {}))
    src = Buffers(64, 64, seed=2)
    assert store.put(["k1"], [src.segments]) == [True]
    path = key_path(tmp_path, "k1")
    data = bytearray(path.read_bytes())
    if damage.startswith("flip a payload byte"):
        data[HEADER_BYTES + 70] ^= 0x01
        if "always" not in damage:
            _from_another_boot(data)  # as after a crash: the value may be torn
    elif damage == "flip a header byte":
        data[3] ^= 0xFF
    elif damage == "truncate":
        data = data[:HEADER_BYTES + 100]
    elif damage == "append":
        data += b"x"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    dst = Buffers(64, 64, seed=3)
    before = dst.value
    assert store.get_into(["k1"], [dst.segments]) == [False]
    if not damage.startswith("flip a payload byte"):  # found before reading: the destination is untouched
        assert dst.value == before
    assert not path.exists()
    assert store.exists(["k1"]) == 0


def test_a_value_from_another_boot_is_checked_once_then_stamped_and_one_of_this_boot_is_not_checked(tmp_path):
    """The CRC is checked where a value may be torn (written before the
    machine's last boot, or by another machine): a good one is stamped with
    this boot and read unchecked from then on. A value of this boot is read
    as the page cache holds it: a byte flipped behind the store's back is
    not looked for (``verify=always`` does)."""
    store = store_at(tmp_path)
    src = Buffers(300, 200, seed=4)
    assert store.put(["old", "new"], [src.segments, src.segments]) == [True, True]
    path = key_path(tmp_path, "old")
    data = bytearray(path.read_bytes())
    stamp = bytes(data[24:32])
    assert stamp == file_module.boot_stamp() != bytes(8)
    _from_another_boot(data)
    path.write_bytes(bytes(data))
    dst = Buffers(300, 200, seed=5)
    assert store.get_into(["old"], [dst.segments]) == [True] and dst.value == src.value
    assert path.read_bytes()[24:32] == stamp  # checked, and stamped with this boot

    crcs = []
    crc = file_module._crc
    def counting(views):
        crcs.append(len(views))
        return crc(views)
    file_module._crc, saved = counting, file_module._crc
    try:
        dst2 = Buffers(300, 200, seed=6)
        assert store.get_into(["old", "new"], [dst2.segments, dst2.segments]) == [True, True]
        assert crcs == []  # both of this boot now: read unchecked
        flipped = bytearray(key_path(tmp_path, "new").read_bytes())
        flipped[HEADER_BYTES + 7] ^= 0x01
        key_path(tmp_path, "new").write_bytes(bytes(flipped))
        assert store.get_into(["new"], [dst2.segments]) == [True]  # not looked for in this mode
        strict = store_at(tmp_path, verify="always")
        assert strict.get_into(["new"], [dst2.segments]) == [False] and crcs == [2]
    finally:
        file_module._crc = saved


def test_a_value_with_no_boot_stamp_is_checked(tmp_path):
    """Files of kvferry before the stamp (zeros there), and every file where
    the boot is not known, have their CRC checked on read."""
    store = store_at(tmp_path)
    src = Buffers(128, seed=7)
    assert store.put(["z"], [src.segments]) == [True]
    path = key_path(tmp_path, "z")
    data = bytearray(path.read_bytes())
    data[24:32] = bytes(8)
    data[HEADER_BYTES] ^= 0x01
    path.write_bytes(bytes(data))
    dst = Buffers(128)  # segments must stay valid for the whole call: keep their owner alive
    assert store.get_into(["z"], [dst.segments]) == [False] and not path.exists()


def test_verify_must_be_a_known_mode(tmp_path):
    with pytest.raises(ValueError, match="verify must be one of boot, always"):
        store_at(tmp_path, verify="sometimes")


def test_least_recently_used_files_are_evicted_under_the_cap(tmp_path):
    value_bytes = 1000
    store = store_at(tmp_path, max_bytes=3 * (HEADER_BYTES + value_bytes) + 10)
    bufs = {k: Buffers(value_bytes, seed=i) for i, k in enumerate("abcde")}
    for k in "abc":
        assert store.put([k + "0"], [bufs[k].segments]) == [True]
    scratch = Buffers(value_bytes)  # segments must stay valid for the whole call: keep their owner alive
    assert store.get_into(["a0"], [scratch.segments]) == [True]  # a is now the most recent
    assert store.put(["d0"], [bufs["d"].segments]) == [True]  # evicts b, the least recent
    assert [store.exists([k + "0"]) for k in "abcd"] == [1, 0, 1, 1]
    assert store.put(["e0"], [bufs["e"].segments]) == [True]  # evicts c
    assert [store.exists([k + "0"]) for k in "abcde"] == [1, 0, 0, 1, 1]
    assert store.total_bytes == 3 * (HEADER_BYTES + value_bytes)
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) == store.total_bytes
    dst = Buffers(value_bytes)
    assert store.get_into(["a0"], [dst.segments]) == [True] and dst.value == bufs["a"].value


def test_a_value_over_the_cap_is_not_stored(tmp_path):
    store = store_at(tmp_path, max_bytes="4KiB")
    big, fits = Buffers(4096), Buffers(4096 - HEADER_BYTES)
    assert store.put(["big"], [big.segments]) == [False]  # plus the header: over
    assert store.put(["fits"], [fits.segments]) == [True]
    assert store.exists(["big"]) == 0 and store.exists(["fits"]) == 1


def test_reopening_rebuilds_the_recency_index_from_mtimes(tmp_path):
    store = store_at(tmp_path)
    for i, k in enumerate(["old", "mid", "new"]):
        src = Buffers(500, seed=i)
        assert store.put([k], [src.segments]) == [True]
        os.utime(key_path(tmp_path, k), (1_000_000 + i, 1_000_000 + i))
    store.close()
    reopened = store_at(tmp_path, max_bytes=2 * (HEADER_BYTES + 500))
    assert reopened.total_bytes == 2 * (HEADER_BYTES + 500)
    assert [reopened.exists([k]) for k in ["old", "mid", "new"]] == [0, 1, 1]


def test_stale_temporary_files_are_removed_at_open_and_fresh_ones_kept(tmp_path):
    store_at(tmp_path).close()
    sub = tmp_path / "store" / "ab"
    sub.mkdir()
    stale, fresh = sub / ".abc.1.2.3.tmp", sub / ".abd.1.2.4.tmp"
    stale.write_bytes(b"x" * 10)
    fresh.write_bytes(b"y" * 10)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    store = store_at(tmp_path)
    assert not stale.exists() and fresh.exists()
    assert store.total_bytes == 0


def test_concurrent_writers_of_one_key_leave_one_whole_value(tmp_path):
    store = store_at(tmp_path)
    values = [Buffers(3000, 5000, seed=10 + i) for i in range(4)]
    wanted = {v.value for v in values}
    assert store.put(["same"], [values[0].segments]) == [True]
    stop = threading.Event()
    torn: list[bytes] = []
    hits = [0]

    def write(v: Buffers) -> None:
        for _ in range(40):
            assert store.put(["same"], [v.segments]) == [True]

    def read() -> None:
        dst = Buffers(3000, 5000)
        while not stop.is_set():
            if store.get_into(["same"], [dst.segments]) == [True]:
                hits[0] += 1
                if dst.value not in wanted:
                    torn.append(dst.value)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(v,)) for v in values]
    for t in writers:
        t.start()
    for t in writers:
        t.join(timeout=60)
    stop.set()
    reader.join(timeout=60)
    assert not torn and hits[0] > 0
    dst = Buffers(3000, 5000)
    assert store.get_into(["same"], [dst.segments]) == [True] and dst.value in wanted
    assert not [p for p in (tmp_path / "store").rglob(".*")]


WRITER = """
import ctypes, sys
from transfer.storage.base import open_storage
root, seed = sys.argv[1], int(sys.argv[2])
data = bytes([seed]) * 65536
buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
store = open_storage("file://" + root)
for _ in range(200):
    assert store.put(["shared"], [[(ctypes.addressof(buf), len(data))]]) == [True]
"""


def test_concurrent_writer_processes_of_one_key_leave_one_whole_value(tmp_path):
    root = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(seed)], cwd=Path(__file__).parents[2])
             for seed in (1, 2)]
    store = store_at(tmp_path)
    dst = (ctypes.c_char * 65536)()
    seen = set()
    while any(p.poll() is None for p in procs):
        if store.get_into(["shared"], [[(ctypes.addressof(dst), 65536)]]) == [True]:
            assert dst.raw in (b"\x01" * 65536, b"\x02" * 65536)
            seen.add(dst.raw[0])
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert store.get_into(["shared"], [[(ctypes.addressof(dst), 65536)]]) == [True]
    assert dst.raw in (b"\x01" * 65536, b"\x02" * 65536)


def test_out_of_space_is_a_miss_and_other_os_errors_raise(tmp_path, monkeypatch):
    store = store_at(tmp_path)
    src = Buffers(100)

    def fail(code):
        def pwritev(*args):
            raise OSError(code, os.strerror(code))
        return pwritev
    monkeypatch.setattr(file_module.os, "pwritev", fail(errno.ENOSPC))
    assert store.put(["k"], [src.segments]) == [False]
    monkeypatch.setattr(file_module.os, "pwritev", fail(errno.EACCES))
    with pytest.raises(StorageError, match="writing k"):
        store.put(["k"], [src.segments])
    monkeypatch.undo()
    assert store.exists(["k"]) == 0
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()], "temporary files removed"


def test_a_relative_url_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open_storage("file://cache/kv?max_bytes=1MiB") as store:
        assert isinstance(store, FileStore) and store.config == FileStoreConfig(root="cache/kv", max_bytes=1 << 20)
        src = Buffers(10)
        assert store.put(["rel"], [src.segments]) == [True]
    assert (tmp_path / "cache" / "kv" / "re" / "rel").is_file()
