"""Prefix-cache block keys, computed exactly as vLLM computes its block hashes.

vLLM (``prefix_caching_hash_algo="sha256"``, its default) hashes each *full* block of
``block_size`` prompt tokens as ``sha256(pickle((parent_hash, tuple(tokens), extra_keys)))``,
chained from ``NONE_HASH = sha256(pickle(seed))``, where the seed is ``PYTHONHASHSEED`` if set,
else ``"vllm-none-hash"``. Its KV events publish the low 64 bits of each hash as an int
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default on). These keys are those ints, so the
router's index and the engines' ``BlockStored`` / ``BlockRemoved`` events name the same blocks.

Only plain token prompts are keyed: no LoRA, multimodal inputs or cache salt (extra_keys None).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterator, Sequence

import numpy as np

DEFAULT_SEED = "vllm-none-hash"
KEY_MASK = (1 << 64) - 1


def none_hash(seed: str | None = None) -> bytes:
    """The chain's root, as vLLM's ``init_none_hash`` derives it for sha256."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    return _sha256(seed)


def block_keys(token_ids: Sequence[int], block_size: int, root: bytes | None = None) -> list[int]:
    """One key per full block of ``token_ids`` (a trailing partial block is never cached)."""
    parent = root if root is not None else none_hash()
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = _sha256((parent, tuple(token_ids[start : start + block_size]), None))
        keys.append(int.from_bytes(digest, "big") & KEY_MASK)
        parent = digest
    return keys


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class BlockKeyer:
    """``block_keys`` with a bounded memo of recent blocks.

    Requests that share a prefix share its first blocks' hashes, and re-hashing them dominates
    a routing decision for long shared prompts. Each block gets a cheap 64-bit fingerprint of its
    tokens (one vectorised pass), chained like vLLM chains its hashes; the memo maps a chained
    fingerprint to vLLM's digest, computed exactly as ``block_keys`` does on a miss. (Two
    different prefixes would have to collide on 64 bits to share a memo entry.)
    """

    def __init__(self, block_size: int, capacity: int = 65_536, seed: str | None = None) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._root = none_hash(seed)
        self._weights = np.random.default_rng(0x5EED).integers(1, 2**63, size=block_size, dtype=np.uint64) | 1
        self._memo: dict[int, bytes] = {}

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        return list(self.iter_keys(token_ids))

    def iter_keys(self, token_ids: Sequence[int]) -> Iterator[int]:
        """Keys one by one, so a caller that stops early (a prefix match) hashes no further."""
        size = self.block_size
        full = len(token_ids) // size
        if not full:
            return
        blocks = np.asarray(token_ids[: full * size], dtype=np.uint64).reshape(full, size)
        fingerprints = (blocks * self._weights).sum(axis=1, dtype=np.uint64).tolist()
        memo, parent, chain = self._memo, self._root, 0
        for index, fingerprint in enumerate(fingerprints):
            chain = hash((chain, fingerprint))
            digest = memo.get(chain)
            if digest is None:
                digest = _sha256((parent, tuple(token_ids[index * size : (index + 1) * size]), None))
                if len(memo) >= self.capacity:
                    memo.pop(next(iter(memo)))
                memo[chain] = digest
            yield int.from_bytes(digest[-8:], "big")
            parent = digest
