from __future__ import annotations

import pytest

from flotilla.router.block_keys import block_keys, none_hash


@pytest.mark.parametrize(("tokens", "block_size"), [(300, 128), (64, 16), (127, 128), (1000, 16)])
def test_keys_equal_vllms_block_hashes(tokens: int, block_size: int) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    token_ids = [(7 * i + 3) % 1000 for i in range(tokens)]
    expected, parent = [], None
    for start in range(0, tokens - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, token_ids[start : start + block_size], None)
        expected.append(kv_cache_utils.maybe_convert_block_hash(parent))
    assert block_keys(token_ids, block_size) == expected
    assert len(expected) == tokens // block_size


def test_keys_chain_on_the_whole_prefix() -> None:
    a = block_keys(list(range(256)), 128)
    b = block_keys(list(range(128)) + list(range(1000, 1128)), 128)
    assert a[0] == b[0] and a[1] != b[1]
    c = block_keys([5] + list(range(1, 256)), 128)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later key


def test_pythonhashseed_changes_the_root(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash() != none_hash("vllm-none-hash")
