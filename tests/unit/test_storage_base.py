"""The storage interface's plumbing: URLs, options, the scheme table, batch checks."""

from dataclasses import dataclass

import pytest

from transfer.storage import base
from transfer.storage.base import (StorageBackend, check_batch, config_from_options, open_storage, parse_bytes,
                                   parse_url, register_scheme)


@pytest.mark.parametrize("url,scheme,location,options", [
    ("file:///var/cache/kv", "file", "/var/cache/kv", {}),
    ("file:///var/cache/kv?max_bytes=10GiB", "file", "/var/cache/kv", {"max_bytes": "10GiB"}),
    ("file://cache/kv", "file", "cache/kv", {}),
    ("file:cache", "file", "cache", {}),
    ("FILE:///x", "file", "/x", {}),
    ("mooncake://10.0.0.5:50051?protocol=rdma&metadata_server=http%3A%2F%2F10.0.0.5%3A8080%2Fmetadata",
     "mooncake", "10.0.0.5:50051", {"protocol": "rdma", "metadata_server": "http://10.0.0.5:8080/metadata"}),
])
def test_urls_split_into_scheme_location_and_options(url, scheme, location, options):
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.location, dict(parsed.options)) == (scheme, location, options)


@pytest.mark.parametrize("url", ["/var/cache", "cache", "mooncake:host:1", "file:///x?a=1&a=2", "file:///x?junk"])
def test_bad_urls_are_refused(url):
    with pytest.raises(ValueError):
        parse_url(url)


@pytest.mark.parametrize("text,value", [
    (4096, 4096), ("4096", 4096), ("64MiB", 64 << 20), ("64MB", 64 << 20), ("4 GB", 4 << 30), ("512k", 512 << 10),
    ("1T", 1 << 40), ("16mib", 16 << 20),
])
def test_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "1.5GiB", "-1", "10 XB", "GiB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@dataclass(frozen=True, kw_only=True)
class _Config:
    root: str
    max_bytes: int = 1
    retries: int = 2
    timeout_s: float = 1.0
    verify: bool = True
    name: str = "x"


def test_options_are_converted_by_the_type_of_their_default():
    cfg = config_from_options(_Config, {"max_bytes": "2KiB", "retries": "5", "timeout_s": "0.5", "verify": "off",
                                        "name": "y"}, "test://", root="/r")
    assert cfg == _Config(root="/r", max_bytes=2048, retries=5, timeout_s=0.5, verify=False, name="y")
    assert config_from_options(_Config, {"retries": 7}, "test://", root="/r").retries == 7


@pytest.mark.parametrize("options,match", [
    ({"nope": "1"}, "unknown option 'nope'"), ({"root": "/other"}, "unknown option 'root'"),
    ({"verify": "maybe"}, "not a boolean"), ({"retries": "two"}, "invalid literal"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        config_from_options(_Config, options, "test://", root="/r")


class _DictStore(StorageBackend):
    """A minimal backend registered under a new scheme."""

    def __init__(self, url, options):
        self.url, self.options, self.closed = url.url, dict(options), False

    def exists(self, keys):
        return 0

    def put(self, keys, segments):
        return [False] * len(keys)

    def get_into(self, keys, segments):
        return [False] * len(keys)

    def close(self):
        self.closed = True


def open_dict_store(url, options):
    return _DictStore(url, options)


def test_a_new_scheme_is_opened_through_the_table_and_keywords_override_the_query(monkeypatch):
    monkeypatch.setattr(base, "_SCHEMES", dict(base._SCHEMES))
    register_scheme("dict", f"{__name__}:open_dict_store")
    with open_storage("dict://anything?a=1&b=2", b=3) as store:
        assert isinstance(store, _DictStore) and store.options == {"a": "1", "b": 3}
        store.register_memory([(4096, 10)])  # the default ignores it
    assert store.closed


def test_an_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="no storage backend for s3://"):
        open_storage("s3://bucket")
    with pytest.raises(ValueError, match="module:function"):
        register_scheme("x", "no_colon")


def test_batches_are_checked():
    assert check_batch(["a", "b"], [[(4096, 10), (8192, 5)], [(4096, 1)]]) == [15, 1]
    with pytest.raises(ValueError, match="2 keys but 1"):
        check_batch(["a", "b"], [[(4096, 1)]])
    with pytest.raises(ValueError, match="twice"):
        check_batch(["a", "a"], [[(4096, 1)], [(4096, 1)]], unique=True)
    assert check_batch(["a", "a"], [[(4096, 1)], [(4096, 1)]]) == [1, 1]
    for bad in [[(0, 1)], [(4096, 0)], [(4096, -1)], [(4096.0, 1)]]:
        with pytest.raises(ValueError, match="segment"):
            check_batch(["a"], [bad])
    with pytest.raises(ValueError, match="invalid storage key"):
        check_batch([7], [[(4096, 1)]])
