"""API keys: constant-time checks against the keys in force, and a key file followed for rotation."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from flotilla.router import api_keys
from flotilla.router.api_keys import KeyFileFollower, KeyRing, parse_keys


def test_keys_parse_from_commas_and_lines() -> None:
    assert parse_keys(" a, b\nc\n\n, ") == ("a", "b", "c")


def test_a_ring_admits_its_keys_only() -> None:
    ring = KeyRing(("env-key",))
    ring.replace_file_keys(("file-key",))
    assert ring.admits("env-key") and ring.admits("file-key")
    assert not ring.admits("") and not ring.admits("env-key ") and not ring.admits("other")
    ring.replace_file_keys(())
    assert not ring.admits("file-key") and ring.admits("env-key")


def test_a_rotated_key_file_takes_effect_without_a_restart(tmp_path: Path) -> None:
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()

    def publish(version: str, text: str) -> None:
        """As the kubelet updates a mounted Secret: a new directory, then the symlink swapped to it."""
        data = tmp_path / version
        data.mkdir()
        (data / "api-keys").write_text(text)
        link = secret_dir / "..data.tmp"
        link.symlink_to(data)
        os.replace(link, secret_dir / "..data")

    publish("v1", "old-key\n")
    (secret_dir / "api-keys").symlink_to(secret_dir / "..data" / "api-keys")
    ring = KeyRing(())

    follower = KeyFileFollower(str(secret_dir / "api-keys"), ring)

    async def scenario() -> None:
        await follower.check()
        assert ring.admits("old-key") and not ring.admits("new-key")
        publish("v2", "old-key,new-key")  # step 1: both keys work while clients move
        await follower.check()
        assert ring.admits("old-key") and ring.admits("new-key")
        publish("v3", "new-key")  # step 2: the old key is retired
        await follower.check()
        assert ring.admits("new-key") and not ring.admits("old-key")
        await follower.check()  # unchanged: nothing reloads
        assert ring.admits("new-key")

    asyncio.run(scenario())


def test_an_unreadable_key_file_admits_nothing(tmp_path: Path) -> None:
    ring = KeyRing(())
    ring.replace_file_keys(api_keys.read_key_file(str(tmp_path / "missing")))
    assert len(ring) == 0 and not ring.admits("")
