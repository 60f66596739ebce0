"""API keys for ``/v1/*``: bearer keys compared in constant time, answered with OpenAI's 401 shape.

Keys come from ``serving.api_keys_env`` (read once at start-up) and ``serving.api_keys_file``, which each
ingress replica reads again whenever it changes, so an operator rotates keys without a restart: add the
new key, move clients, remove the old one (runbooks/api-key-rotation.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)
KEY_FILE_POLL_S = 2.0
API_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/tokenize", "/detokenize", "/invocations")
"""Paths that need the API key when keys are configured (vLLM guards /v1 the same way)."""


def parse_keys(text: str) -> tuple[str, ...]:
    return tuple(key.strip() for key in text.replace("\n", ",").split(",") if key.strip())


class KeyRing:
    """The keys in force, kept as SHA-256 digests (never logged, compared in constant time)."""

    def __init__(self, fixed: tuple[str, ...]) -> None:
        self._fixed = [self._digest(key) for key in fixed]
        self._from_file: list[bytes] = []

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def replace_file_keys(self, keys: tuple[str, ...]) -> None:
        self._from_file = [self._digest(key) for key in keys]

    def admits(self, key: str) -> bool:
        digest = self._digest(key)
        return any(secrets.compare_digest(digest, known) for known in self._fixed + self._from_file)

    def __len__(self) -> int:
        return len(self._fixed) + len(self._from_file)


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys in ``path``; an unreadable file holds none (the ring then admits only the fixed keys)."""
    try:
        return parse_keys(Path(path).read_text())
    except OSError as err:
        logger.error("cannot read the API key file %s: %s; its keys are not accepted", path, err)
        return ()


class KeyFileFollower:
    """Loads ``path`` into ``ring`` whenever it changes (Kubernetes swaps a mounted Secret's files through a
    symlink, which changes the file's inode as well as its mtime)."""

    def __init__(self, path: str, ring: KeyRing) -> None:
        self.path = path
        self.ring = ring
        self._seen: tuple[int, int, int] | None | bool = False  # False: never loaded

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    async def check(self) -> None:
        """Reload the keys if the file changed since the last check (file I/O off the event loop)."""
        current = await asyncio.to_thread(self._signature)
        if current != self._seen:
            keys = await asyncio.to_thread(read_key_file, self.path)
            self.ring.replace_file_keys(keys)
            logger.info("API key file %s loaded: %d key(s)", self.path, len(keys))
            self._seen = current

    async def follow(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(KEY_FILE_POLL_S)


class ApiKeyMiddleware:
    """Bearer API keys on the API paths; a 401 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, ring: KeyRing, unauthorized: Callable[[], Response]) -> None:
        self.app = app
        self.ring = ring
        self.unauthorized = unauthorized

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(API_PREFIXES):
            scheme, _, key = (Headers(scope=scope).get("authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not self.ring.admits(key):
                await self.unauthorized()(scope, receive, send)
                return
        await self.app(scope, receive, send)
