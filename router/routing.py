"""The routing decision, free of Ray and HTTP: prefix index + live load → policy → bookkeeping.

The ingress (and the simulator) call :meth:`Router.route` for each request, then
:meth:`Router.first_token` and :meth:`Router.finished` as it progresses. The router keeps every
group's signals in numpy columns (one row per group): requests in flight and prefill still
queued (from its own decisions) and engine-side load (from :meth:`update_engine_load`); per
request it adds the cached prefix each group holds, then lets the policy pick a row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flotilla.router.block_keys import BlockKeyer
from flotilla.router.policies import Candidates, GroupView, RoutingPolicy, RoutingRequest
from flotilla.router.prefix_index import PrefixIndex

INITIAL_ROWS = 16
PREFILL_PACE_DECAY = 0.9
"""Weight of a group's earlier prefill-pace samples against its newest (about the last ten count)."""


@dataclass(slots=True)
class EngineLoad:
    """A group's load as its engine last reported it."""

    running: int
    waiting: int
    kv_usage: float


@dataclass(slots=True)
class Decision:
    request: RoutingRequest
    group: str
    matched_blocks: int
    """Leading blocks the chosen group held (by the index's knowledge)."""
    best_matched_blocks: int
    """The longest match any group held: the prefix reuse an oracle would get."""
    uncached_tokens: int
    decision_s: float
    row: int
    head: int | None = None
    """The prompt's first block (hashed), while its prefill is counted in ``Router._prefilling``."""
    sent_s: float = 0.0
    """When it was routed, by the router's clock."""
    first_in_line: bool = False
    """No prefill of this router's was pending on the group when it was sent: its time to a first token is the
    group's pace of prefill (:meth:`Router.first_token` learns it)."""
    first_token_seen: bool = False
    tokens: np.ndarray | None = field(default=None, repr=False, compare=False)
    """The prompt as an array, once another request compared itself with it (:meth:`Router._shared_in_prefill`)."""


class NoRoutableGroup(Exception):
    """No group can take requests now."""


class Router:
    def __init__(
        self,
        policy: RoutingPolicy,
        block_size: int,
        index: PrefixIndex | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.policy = policy
        self.block_size = block_size
        self.index = index or PrefixIndex()
        self._clock = clock
        self._keyer = BlockKeyer(block_size)
        self._rows: dict[str, int] = {}
        self._names: list[str] = []
        self._live = np.zeros(INITIAL_ROWS, dtype=bool)
        self._in_flight = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self._pending = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self._running = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self._waiting = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self._kv_usage = np.zeros(INITIAL_ROWS, dtype=np.float64)
        self._capacity = np.zeros(INITIAL_ROWS, dtype=np.int64)
        self._slot = np.zeros(INITIAL_ROWS, dtype=np.int64)  # the group's column in index.held
        self._prefill_since = np.zeros(INITIAL_ROWS, dtype=np.float64)  # when the group began its pending prefill
        self._paced_tokens = np.zeros(INITIAL_ROWS, dtype=np.float64)  # decayed sums of first-in-line prefills:
        self._paced_s = np.zeros(INITIAL_ROWS, dtype=np.float64)  # their uncached tokens and times to first token
        self._live_rows = np.zeros(0, dtype=np.int64)
        self._prefilling: dict[int, dict[int, list[Decision]]] = {}  # first block → row → requests not yet prefilled

    # --- membership --------------------------------------------------------------------------
    @property
    def group_names(self) -> list[str]:
        return [self._names[row] for row in self._live_rows]

    def add_group(self, name: str, capacity_blocks: int) -> None:
        """Route to ``name`` (again). A returning group keeps this router's own count of its requests
        still in flight (they finish against it) but not its old engine load."""
        self.index.add_group(name, capacity_blocks)
        row = self._rows.get(name)
        if row is not None and self._live[row]:
            self._capacity[row] = capacity_blocks
            return
        if row is None:
            row = len(self._names)
            if row == len(self._live):
                self._grow()
            self._rows[name] = row
            self._names.append(name)
            self._in_flight[row] = self._pending[row] = 0
            self._paced_tokens[row] = self._paced_s[row] = 0.0
        for column in (self._running, self._waiting, self._kv_usage):
            column[row] = 0
        self._capacity[row], self._slot[row] = capacity_blocks, self.index.slot(name)
        self._live[row] = True
        self._live_rows = np.flatnonzero(self._live)

    def remove_group(self, name: str) -> None:
        row = self._rows.get(name)
        if row is not None:
            self._live[row] = False
            self._live_rows = np.flatnonzero(self._live)
        self.index.remove_group(name)

    def update_engine_load(self, name: str, load: EngineLoad) -> None:
        row = self._rows.get(name)
        if row is not None:
            self._running[row], self._waiting[row], self._kv_usage[row] = load.running, load.waiting, load.kv_usage

    def view(self, name: str) -> GroupView:
        row = self._rows[name]
        return GroupView(
            name,
            int(self._in_flight[row]),
            int(self._pending[row]),
            int(self._running[row]),
            int(self._waiting[row]),
            float(self._kv_usage[row]),
        )

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read time from ``clock`` from now on (the simulator's virtual time)."""
        self._clock = clock

    # --- requests ----------------------------------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: list[int], exclude: frozenset[str] = frozenset()) -> Decision:
        """Pick a group for the request; ``exclude`` names groups that already failed it."""
        rows = self._live_rows
        if exclude:
            rows = rows[~np.isin(rows, [self._rows[name] for name in exclude if name in self._rows])]
        if not len(rows):
            raise NoRoutableGroup(
                "no replica group is routable" + (" (the others failed this request)" if exclude else "")
            )
        started = self._clock()
        matches = self.index.match(self._keyer.iter_keys(prompt_token_ids))  # hashes only as far as it matches
        head = self._head(prompt_token_ids)
        request = RoutingRequest(request_id, prompt_token_ids, self.block_size, head=head)
        matched = _candidate_column(rows, {self._rows[name]: depth for name, depth in matches.items()})
        best = int(matched.max())
        in_prefill = self._prefilling.get(head, {}) if head is not None else {}
        prefilling = _candidate_column(rows, {row: len(decisions) for row, decisions in in_prefill.items()})
        computing = _candidate_column(rows, self._shared_in_prefill(in_prefill, prompt_token_ids))
        pick = slice(0, len(rows)) if rows[-1] == len(rows) - 1 else rows  # all live: views, no copies
        candidates = Candidates(
            in_flight=self._in_flight[pick],
            pending_prefill_tokens=self._pending[pick],
            prefill_done_tokens=self._prefill_done(pick, started),
            engine_running=self._running[pick],
            engine_waiting=self._waiting[pick],
            kv_usage=self._kv_usage[pick],
            matched_blocks=matched,
            free_blocks=self._capacity[pick] - self.index.held[self._slot[pick]],
            prefilling=prefilling,
            prefilling_blocks=computing,
            capacity_blocks=self._capacity[pick],
            group_ids=rows,
        )
        choice = self.policy.choose(request, candidates)
        row = int(rows[choice])
        request.group_id = row
        name = self._names[row]
        chosen_matched = int(matched[choice])
        expected_hits = max(chosen_matched, int(computing[choice]))  # what vLLM will find cached when it schedules it
        uncached = max(0, request.prompt_tokens - expected_hits * self.block_size)
        first_in_line = bool(self._pending[row] == 0)
        if first_in_line:
            self._prefill_since[row] = started
        self._in_flight[row] += 1
        self._pending[row] += uncached
        decision = Decision(
            request, name, chosen_matched, best, uncached, self._clock() - started, row, head, started, first_in_line
        )
        if head is not None:
            self._prefilling.setdefault(head, {}).setdefault(row, []).append(decision)
        self.policy.on_routed(request, name)
        return decision

    def _shared_in_prefill(self, in_prefill: dict[int, list[Decision]], prompt_token_ids: list[int]) -> dict[int, int]:
        """Per row: the most leading blocks of this prompt that a request being prefilled there shares."""
        if not in_prefill:
            return {}
        prompt = np.asarray(prompt_token_ids)
        whole = len(prompt) // self.block_size
        shared: dict[int, int] = {}
        for row, decisions in in_prefill.items():
            most = 0
            for decision in decisions:
                if decision.tokens is None:
                    decision.tokens = np.asarray(decision.request.prompt_token_ids)
                most = max(most, _shared_blocks(decision.tokens, prompt, self.block_size))
                if most == whole:
                    break
            shared[row] = most
        return shared

    def first_token(self, decision: Decision) -> None:
        """The prompt is prefilled: the group now caches its full blocks (which also renews them in its LRU)."""
        if decision.first_token_seen:
            return
        if decision.first_in_line and decision.uncached_tokens:
            row = decision.row
            self._paced_tokens[row] = PREFILL_PACE_DECAY * self._paced_tokens[row] + decision.uncached_tokens
            self._paced_s[row] = PREFILL_PACE_DECAY * self._paced_s[row] + self._clock() - decision.sent_s
        self._prefilled(decision)
        request = decision.request
        request.block_keys = self._keyer.keys(request.prompt_token_ids)
        if self._live[decision.row] and self.index.has_group(decision.group):
            self.index.record_confirmed(decision.group, request.block_keys)

    def finished(self, decision: Decision, output_token_ids: list[int] | None = None) -> None:
        """The request ended; with its output, the blocks it filled while decoding are known too."""
        if decision.first_token_seen and output_token_ids and self.index.has_group(decision.group):
            full = self._keyer.keys(decision.request.prompt_token_ids + output_token_ids)
            self.index.record_confirmed(
                decision.group, full[len(decision.request.prompt_token_ids) // self.block_size :]
            )
        if not decision.first_token_seen:  # failed or aborted before its prefill finished
            self._prefilled(decision)
        self._in_flight[decision.row] -= 1
        self.policy.on_finished(decision.request, decision.group)

    def _prefilled(self, decision: Decision) -> None:
        decision.first_token_seen = True
        self._pending[decision.row] -= decision.uncached_tokens
        self._prefill_since[decision.row] = self._clock()  # the next prefill in line, if any, goes on from now
        if decision.head is not None:
            heads = self._prefilling[decision.head]
            heads[decision.row].remove(decision)
            if not heads[decision.row]:
                del heads[decision.row]
                if not heads:
                    del self._prefilling[decision.head]

    def _prefill_done(self, rows: slice | np.ndarray, now: float) -> np.ndarray:
        """Per candidate: how much of its pending prefill the group has likely done, in tokens: the time since it
        began at the pace its first-in-line prefills kept, or, until one was timed there, the pace of every group's
        together (none until the router timed one)."""
        seconds = self._paced_s[rows]
        timed = self._paced_s[self._live_rows].sum()
        pooled = self._paced_tokens[self._live_rows].sum() / timed if timed > 0 else 0.0
        pace = np.divide(self._paced_tokens[rows], seconds, out=np.full(len(seconds), pooled), where=seconds > 0)
        return np.minimum(self._pending[rows], (now - self._prefill_since[rows]) * pace)

    def _head(self, prompt_token_ids: list[int]) -> int | None:
        """The first full block of the prompt, hashed (None for a prompt shorter than a block)."""
        if len(prompt_token_ids) < self.block_size:
            return None
        return hash(tuple(prompt_token_ids[: self.block_size]))

    def _grow(self) -> None:
        size = 2 * len(self._live)
        for attr in (
            *("_live", "_in_flight", "_pending", "_running", "_waiting", "_kv_usage", "_capacity", "_slot"),
            *("_prefill_since", "_paced_tokens", "_paced_s"),
        ):
            column = getattr(self, attr)
            grown = np.zeros(size, dtype=column.dtype)
            grown[: len(column)] = column
            setattr(self, attr, grown)


def _shared_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """Leading full blocks two prompts have in common."""
    n = min(len(a), len(b)) // block_size * block_size
    if not n:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0] if len(differ) else n) // block_size


def _candidate_column(rows: np.ndarray, by_row: dict[int, int]) -> np.ndarray:
    """``by_row``'s values at the candidates' positions (``rows``, ascending); rows not among them are left out."""
    column = np.zeros(len(rows), dtype=np.int64)
    for row, value in by_row.items():
        position = np.searchsorted(rows, row)
        if position < len(rows) and rows[position] == row:
            column[position] = value
    return column
