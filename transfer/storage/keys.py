"""Storage keys of KV pages: a hash chain over the tokens, bound to a pool's fingerprint.

Pure (hashlib, json and struct only). A key names a *full* page together
with everything before it, and the pool whose bytes it holds:

- the chain: ``chain_0 = H(tokens of page 0)``, ``chain_i = H(chain_{i-1} ||
  tokens of page i)``, so equal chain hashes mean equal prefixes up to and
  including that page (a partial last page has no key: its bytes change as
  tokens are appended);
- the fingerprint: what makes two pools' bytes comparable (model, pool role,
  attention kind, page layout, dtype, page size, layers, heads, head dim, TP
  slice), hashed once per pool;
- the key: ``H(fingerprint digest || chain_i)`` as 32 lowercase hex digits,
  safe as a file name and as a Mooncake Store key.

So the target and the draft pool of one request, or two TP ranks' head
slices, store the same prefix under disjoint keys, and a chain can be computed
once per request and bound to each pool with :func:`keys_from_chain`.

Changing how keys are derived changes every key: bump :data:`KEY_VERSION`
(it is part of every fingerprint digest), which makes old entries unreachable
instead of misread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from collections.abc import Iterable, Sequence

KEY_VERSION = 1
_DIGEST_BYTES = 16
_TOKEN = struct.Struct("<Q")


def _blake(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES, person=person).digest()


def _plain(value):
    """An enum member (``PoolRole.DRAFT``, ``AttentionKind.MLA``...) as its value."""
    return getattr(value, "value", value)


@dataclass(frozen=True, kw_only=True)
class PoolFingerprint:
    """What must match for a stored page to be loaded into a pool.

    ``model`` names the weights (include the revision: two checkpoints of one
    architecture produce different KV). ``role`` is ``target`` or ``draft``,
    ``attention`` ``mha`` or ``mla``, ``page_layout`` ``nhd`` or ``hnd``
    (``PoolRole``/``AttentionKind``/``PageLayout`` members are accepted and
    stored as their values). ``num_kv_heads`` and ``head_dim`` describe this
    rank's page (MLA: 1 and the latent width). ``tp_rank``/``tp_size`` name
    the head slice of an MHA pool; an MLA pool is the same on every rank, so
    give it ``tp_rank=0, tp_size=1`` to share its pages across ranks.
    ``extra`` is anything else that changes the bytes (a LoRA adapter, a KV
    quantisation scheme).
    """

    model: str
    role: str
    attention: str
    page_layout: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    extra: str = ""

    def __post_init__(self) -> None:
        for name in ("role", "attention", "page_layout"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if not self.model:
            raise ValueError("PoolFingerprint.model must not be empty")
        if self.role not in ("target", "draft"):
            raise ValueError(f"PoolFingerprint.role must be 'target' or 'draft', got {self.role!r}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"PoolFingerprint.attention must be 'mha' or 'mla', got {self.attention!r}")
        if self.page_layout not in ("nhd", "hnd"):
            raise ValueError(f"PoolFingerprint.page_layout must be 'nhd' or 'hnd', got {self.page_layout!r}")
        if not self.dtype:
            raise ValueError("PoolFingerprint.dtype must not be empty")
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PoolFingerprint.{name} must be a positive int, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"PoolFingerprint.tp_rank {self.tp_rank!r} not in [0, {self.tp_size})")

    @functools.cached_property
    def digest(self) -> bytes:
        """16 bytes naming this fingerprint (and :data:`KEY_VERSION`)."""
        text = json.dumps({"key_version": KEY_VERSION, **asdict(self)}, sort_keys=True, separators=(",", ":"))
        return _blake(text.encode(), b"kvferry-pool")


def _token_list(token_ids) -> list[int]:
    return token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)


def chain_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The chain hash of every full page of ``token_ids`` (16 bytes each);
    a trailing partial page has none. Raises ValueError on a token outside
    ``[0, 2**64)`` or a page size < 1."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    tokens = _token_list(token_ids)
    page = struct.Struct(f"<{page_size}Q")
    chains, previous = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        try:
            packed = page.pack(*tokens[start:start + page_size])
        except struct.error as exc:
            raise ValueError(f"token ids of page {start // page_size} must be ints in [0, 2**64): {exc}") from exc
        previous = _blake(previous + packed, b"kvferry-chain")
        chains.append(previous)
    return chains


def keys_from_chain(fingerprint: PoolFingerprint, chains: Iterable[bytes]) -> list[str]:
    """Bind chain hashes (from :func:`chain_hashes`) to one pool: its storage keys."""
    digest = fingerprint.digest
    return [_blake(digest + chain, b"kvferry-key").hex() for chain in chains]


def page_keys(fingerprint: PoolFingerprint, token_ids: Sequence[int], page_size: int | None = None) -> list[str]:
    """The storage key of every full page of ``token_ids`` in the pool that
    ``fingerprint`` describes (``page_size`` defaults to the fingerprint's;
    a different one is refused with ValueError)."""
    if page_size is not None and page_size != fingerprint.page_size:
        raise ValueError(f"page_size {page_size} differs from the fingerprint's {fingerprint.page_size}")
    return keys_from_chain(fingerprint, chain_hashes(token_ids, fingerprint.page_size))
