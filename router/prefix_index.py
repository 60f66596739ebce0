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

Layout, for a million blocks over a thousand groups: each block key maps to bitmasks of the
groups holding it, one per source (plain ints, so the index is invisible to Python's cycle
collector), and each group keeps a dict of its keys in LRU order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

CONFIRMED = 1
STORED = 2


@dataclass(slots=True)
class _GroupCache:
    bit: int
    capacity_blocks: int
    precise: bool = False
    # key → (source bits, last time confirmed); dict order is LRU order (oldest first).
    entries: dict[int, tuple[int, float]] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, confirmed_grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.confirmed_grace_s = confirmed_grace_s
        self._clock = clock
        self._stored: dict[int, int] = {}  # block key → bitmask of groups with a stored entry
        self._confirmed: dict[int, int] = {}  # block key → bitmask of groups with a confirmed entry
        self._groups: dict[str, _GroupCache] = {}
        self._names: dict[int, str] = {}  # bit → group
        self._precise_mask = 0
        self.held = np.zeros(64, dtype=np.int64)
        """Entries per group, by :meth:`slot`: a column the router reads without a loop over groups."""

    # --- groups ----------------------------------------------------------------------------------
    def add_group(self, group: str, capacity_blocks: int) -> None:
        if group in self._groups:
            self._groups[group].capacity_blocks = capacity_blocks
            return
        bit = next(b for b in range(len(self._names) + 1) if b not in self._names)
        self._groups[group] = _GroupCache(1 << bit, capacity_blocks)
        self._names[bit] = group
        if bit >= len(self.held):
            self.held = np.concatenate([self.held, np.zeros(len(self.held), dtype=np.int64)])
        self.held[bit] = 0

    def slot(self, group: str) -> int:
        """The group's position in :attr:`held` (stable while it is indexed)."""
        return self._groups[group].bit.bit_length() - 1

    def remove_group(self, group: str) -> None:
        cache = self._groups.get(group)
        if cache is None:
            return
        self.clear(group)
        self._precise_mask &= ~cache.bit
        del self._names[cache.bit.bit_length() - 1]
        del self._groups[group]

    def has_group(self, group: str) -> bool:
        return group in self._groups

    def set_precise(self, group: str, precise: bool) -> None:
        cache = self._groups[group]
        cache.precise = precise
        if precise:
            self._precise_mask |= cache.bit
        else:
            self._precise_mask &= ~cache.bit

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
                lost = self._stored if source & STORED else self._confirmed
                remaining = lost.get(key, 0) & ~cache.bit
                if remaining:
                    lost[key] = remaining
                else:
                    lost.pop(key, None)
            else:
                self._drop(cache, key)

    def keys(self, group: str) -> list[int]:
        """The group's entries, least recently used first."""
        return list(self._groups[group].entries)

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
                self._drop(cache, key)

    # --- reads -----------------------------------------------------------------------------------
    def match(self, keys: Iterable[int], groups: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of ``keys`` each group holds (groups holding none are left out).

        ``keys`` may be a lazy iterator: it is read only up to the first block no group holds.
        """
        active = -1 if groups is None else self._mask(groups)
        approximate = ~self._precise_mask
        depth_of: dict[int, int] = {}
        now = self._clock()
        for depth, key in enumerate(keys, start=1):
            confirmed = self._confirmed.get(key, 0)
            usable = self._stored.get(key, 0) | (confirmed & approximate)
            pending = confirmed & self._precise_mask & active & ~usable
            if pending:  # precise groups' own confirmations, still awaiting their BlockStored
                usable |= self._recent(pending, key, now)
            active &= usable
            if not active:
                break
            bits = active
            while bits:
                low = bits & -bits
                depth_of[low] = depth
                bits ^= low
        return {self._names[bit.bit_length() - 1]: depth for bit, depth in depth_of.items()}

    def touch(self, group: str, keys: Sequence[int]) -> None:
        """Mark blocks as just used (the engine's LRU does the same on a hit)."""
        entries = self._groups[group].entries
        for key in keys:
            value = entries.pop(key, None)
            if value is not None:
                entries[key] = value

    # --- internals -------------------------------------------------------------------------------
    def _mask(self, groups: Iterable[str]) -> int:
        mask = 0
        for group in groups:
            cache = self._groups.get(group)
            if cache is not None:
                mask |= cache.bit
        return mask

    def _recent(self, groups: int, key: int, now: float) -> int:
        """Of ``groups``, those that confirmed ``key`` within the grace period."""
        kept = 0
        while groups:
            low = groups & -groups
            groups ^= low
            _, confirmed_at = self._groups[self._names[low.bit_length() - 1]].entries[key]
            if now - confirmed_at <= self.confirmed_grace_s:
                kept |= low
        return kept

    def _add(self, group: str, keys: Iterable[int], source: int, confirmed_at: float | None) -> None:
        cache = self._groups[group]
        entries, bit = cache.entries, cache.bit
        holders = self._stored if source == STORED else self._confirmed
        for key in keys:
            old = entries.pop(key, None)
            if old is None:
                entries[key] = (source, confirmed_at or 0.0)
            else:
                entries[key] = (old[0] | source, confirmed_at if confirmed_at is not None else old[1])
            holders[key] = holders.get(key, 0) | bit
        while len(entries) > cache.capacity_blocks:
            self._drop(cache, next(iter(entries)))
        self.held[bit.bit_length() - 1] = len(entries)

    def _drop(self, cache: _GroupCache, key: int) -> None:
        del cache.entries[key]
        self.held[cache.bit.bit_length() - 1] -= 1
        for holders in (self._stored, self._confirmed):
            remaining = holders.get(key, 0) & ~cache.bit
            if remaining:
                holders[key] = remaining
            else:
                holders.pop(key, None)
