"""Which groups hold which prefix-cache blocks: the router's view of every engine's cache.

Entries come from two sources:

* **confirmed** (approximate): the router's own knowledge — once a request routed to a group
  produced its first token, its prompt blocks are in that group's cache (and, when it
  finishes, its prompt + output blocks). Nothing is recorded at routing time: vLLM does not
  share a prefill that is still running, so a request sent along would compute it again.
* **stored** (precise): the engine's own KV events, ``BlockStored`` adds and ``BlockRemoved``
  deletes, ``AllBlocksCleared`` empties the group.

A group whose event feed is live (``set_precise(group, True)``) is matched on stored entries
plus confirmed entries younger than ``confirmed_grace_s`` (its events may still be on their
way); otherwise on all its entries. Every group's entries form an LRU bounded by its KV
capacity in blocks, like the engine's own cache.

``match`` walks the request's keys from the first block and stops at the first block no
candidate holds: a prefix cache can only reuse a consecutive run from the start.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

CONFIRMED = 1
STORED = 2


@dataclass(slots=True)
class _GroupCache:
    capacity_blocks: int
    precise: bool = False
    # key → (source bits, last time confirmed); insertion order is LRU order.
    entries: OrderedDict[int, tuple[int, float]] = field(default_factory=OrderedDict)


class PrefixIndex:
    def __init__(self, confirmed_grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.confirmed_grace_s = confirmed_grace_s
        self._clock = clock
        self._holders: dict[int, set[str]] = {}
        self._groups: dict[str, _GroupCache] = {}

    # --- groups ----------------------------------------------------------------------------------
    def add_group(self, group: str, capacity_blocks: int) -> None:
        if group in self._groups:
            self._groups[group].capacity_blocks = capacity_blocks
        else:
            self._groups[group] = _GroupCache(capacity_blocks)

    def remove_group(self, group: str) -> None:
        self.clear(group)
        self._groups.pop(group, None)

    def has_group(self, group: str) -> bool:
        return group in self._groups

    def set_precise(self, group: str, precise: bool) -> None:
        self._groups[group].precise = precise

    def is_precise(self, group: str) -> bool:
        return self._groups[group].precise

    def clear(self, group: str, source: int = CONFIRMED | STORED) -> None:
        """Forget ``source`` entries of ``group`` (both by default: the engine restarted)."""
        cache = self._groups.get(group)
        if cache is None:
            return
        for key, (bits, confirmed_at) in list(cache.entries.items()):
            if bits & ~source:
                cache.entries[key] = (bits & ~source, confirmed_at)
            else:
                self._drop(group, cache, key)

    def size(self, group: str | None = None) -> int:
        if group is not None:
            return len(self._groups[group].entries)
        return sum(len(cache.entries) for cache in self._groups.values())

    # --- writes ----------------------------------------------------------------------------------
    def record_confirmed(self, group: str, keys: Iterable[int]) -> None:
        self._add(group, keys, CONFIRMED, self._clock())

    def record_stored(self, group: str, keys: Iterable[int]) -> None:
        self._add(group, keys, STORED, None)

    def record_removed(self, group: str, keys: Iterable[int]) -> None:
        cache = self._groups.get(group)
        if cache is None:
            return
        for key in keys:
            if key in cache.entries:
                self._drop(group, cache, key)

    # --- reads -----------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], groups: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of ``keys`` each group holds (groups holding none are left out)."""
        candidates = None if groups is None else set(groups)
        active: set[str] | None = None
        matched: dict[str, int] = {}
        now = self._clock()
        for depth, key in enumerate(keys, start=1):
            holders = self._holders.get(key)
            if not holders:
                break
            pool = holders if active is None else active & holders
            if active is None and candidates is not None:
                pool = pool & candidates
            active = {g for g in pool if self._usable(self._groups[g], key, now)}
            if not active:
                break
            for group in active:
                matched[group] = depth
        return matched

    def touch(self, group: str, keys: Sequence[int]) -> None:
        """Mark blocks as just used (the engine's LRU does the same on a hit)."""
        cache = self._groups[group]
        for key in keys:
            if key in cache.entries:
                cache.entries.move_to_end(key)

    # --- internals -------------------------------------------------------------------------------
    def _usable(self, cache: _GroupCache, key: int, now: float) -> bool:
        if not cache.precise:
            return True
        bits, confirmed_at = cache.entries[key]
        return bool(bits & STORED) or now - confirmed_at <= self.confirmed_grace_s

    def _add(self, group: str, keys: Iterable[int], source: int, confirmed_at: float | None) -> None:
        cache = self._groups[group]
        entries = cache.entries
        for key in keys:
            old = entries.get(key)
            if old is None:
                entries[key] = (source, confirmed_at or 0.0)
                self._holders.setdefault(key, set()).add(group)
            else:
                entries[key] = (old[0] | source, confirmed_at if confirmed_at is not None else old[1])
                entries.move_to_end(key)
        while len(entries) > cache.capacity_blocks:
            oldest = next(iter(entries))
            self._drop(group, cache, oldest)

    def _drop(self, group: str, cache: _GroupCache, key: int) -> None:
        del cache.entries[key]
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(group)
            if not holders:
                del self._holders[key]
