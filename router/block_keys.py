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
from collections.abc import Sequence

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
