"""A simulated engine group for routing and control-logic tests at scale (hundreds to 1,000 groups).

It behaves like vLLM where routing can see it, in virtual time:

* a paged KV cache of ``num_blocks`` blocks with prefix caching: full blocks are keyed exactly
  like vLLM's (``router.block_keys``) over prompt + output, blocks of finished requests stay
  cached and are evicted least recently used first;
* a scheduler step schedules the running requests' prefill chunks first, then admits waiting
  requests while blocks are free and the step's ``max_batched_tokens`` last (chunked prefill),
  and decodes one token for every running request; a step lasts ``step_overhead_s`` + prefill
  tokens × ``prefill_s_per_token`` + decoding requests × ``decode_s_per_seq``;
* a prompt block is shareable from the step that schedules its computation on, as vLLM caches it
  then: a request admitted after the one computing a prefix finds it cached;
* it reports the same stats (running, waiting, KV usage, prefix-cache queries and hits) and
  emits the same KV events (``stored`` for newly cached full blocks, ``removed`` on eviction).

It never stands in for vLLM in acceptance tests of the serving path.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flotilla.router.block_keys import block_keys, none_hash


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    block_size: int = 128
    num_blocks: int = 1024
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    prefill_s_per_token: float = 0.5e-3  # ≈ the 27M-parameter benchmark model on one CPU core
    decode_s_per_seq: float = 1.5e-3
    step_overhead_s: float = 5e-3


@dataclass(frozen=True, slots=True)
class KvEvent:
    kind: str  # "stored" | "removed"
    keys: tuple[int, ...]


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    output: list[int]
    """The tokens it will generate (workloads fix them, so a follow-up turn can reuse them)."""
    arrival_s: float
    keys: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated: int = 0
    private_blocks: int = 0
    own_keys: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def prefill_done(self) -> bool:
        return self.computed_tokens >= len(self.prompt)


class SimEngine:
    def __init__(
        self, name: str, config: SimEngineConfig, on_events: Callable[[str, list[KvEvent]], None] | None = None
    ) -> None:
        self.name = name
        self.config = config
        self.on_events = on_events
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished: list[SimRequest] = []
        self.cached: OrderedDict[int, None] = OrderedDict()  # free blocks still holding a prefix, LRU first
        self.pinned: dict[int, int] = {}  # keyed blocks in use → requests using them
        self.private_blocks = 0  # blocks in use that hold no full block of tokens yet
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._root = none_hash()

    # --- stats -----------------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return len(self.pinned) + self.private_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.config.num_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: SimRequest) -> None:
        request.keys = block_keys(request.prompt + request.output, self.config.block_size, self._root)
        self.waiting.append(request)

    # --- one scheduler iteration -----------------------------------------------------------------
    def step(self, now_s: float) -> float:
        """Run one step starting at ``now_s``; returns its duration (0 when there is nothing to do)."""
        events: list[KvEvent] = []
        decoding = sum(1 for request in self.running if request.prefill_done)
        budget = self.config.max_batched_tokens
        for request in self.running:  # like vLLM's scheduler: running requests first, then waiting ones
            if not request.prefill_done and budget > 0:
                budget -= self._prefill_chunk(request, budget, events)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            admitted = self._admit(events)
            if admitted is None:
                break
            budget -= self._prefill_chunk(admitted, budget, events)
        prefill_tokens = self.config.max_batched_tokens - budget
        if not prefill_tokens and not decoding:
            self._emit(events)
            return 0.0
        cfg = self.config
        end = now_s + cfg.step_overhead_s + prefill_tokens * cfg.prefill_s_per_token + decoding * cfg.decode_s_per_seq
        for request in list(self.running):
            if not request.prefill_done:
                continue
            request.generated += 1
            if request.first_token_s is None:
                request.first_token_s = end
            if request.generated >= len(request.output):
                request.finished_s = end
                self._finish(request, events)
        self._emit(events)
        return end - now_s

    # --- KV cache ----------------------------------------------------------------------------------
    def _admit(self, events: list[KvEvent]) -> SimRequest | None:
        """The first waiting request, now running with its cached prefix; None while its blocks do not fit."""
        size = self.config.block_size
        request = self.waiting[0]
        hits = 0
        for key in request.keys[: len(request.prompt) // size]:
            if key not in self.pinned and key not in self.cached:
                break
            hits += 1
        if hits * size >= len(request.prompt):  # vLLM always recomputes the last prompt token
            hits -= 1
        hit_keys = request.keys[:hits]
        new_blocks = math.ceil((len(request.prompt) + len(request.output)) / size) - hits
        free = self.config.num_blocks - self.used_blocks - len(self.cached)
        evictable = len(self.cached) - sum(1 for key in hit_keys if key in self.cached)
        if new_blocks > free + evictable:
            return None  # waits until running requests free blocks
        self.waiting.popleft()
        for key in hit_keys:
            self._pin(key)
        if new_blocks > free:
            self._evict(new_blocks - free, events)
        request.private_blocks = new_blocks
        self.private_blocks += new_blocks
        self.prefix_queries += len(request.prompt)
        self.prefix_hits += hits * size
        request.cached_tokens = request.computed_tokens = hits * size
        request.own_keys = list(hit_keys)
        self.running.append(request)
        return request

    def _prefill_chunk(self, request: SimRequest, budget: int, events: list[KvEvent]) -> int:
        """Schedule up to ``budget`` of the request's uncached prompt tokens; returns how many."""
        size = self.config.block_size
        chunk = min(budget, len(request.prompt) - request.computed_tokens)
        before = request.computed_tokens // size
        request.computed_tokens += chunk
        self._store_prompt_blocks(request, request.keys[before : request.computed_tokens // size], events)
        return chunk

    def _store_prompt_blocks(self, request: SimRequest, keys: list[int], events: list[KvEvent]) -> None:
        """The prompt blocks ``keys`` this step fills become shareable now, as vLLM caches a block when it schedules its
        computation (``KVCacheManager.allocate_slots``): a request scheduled after this one, in this step or a
        later one, finds them cached. The engine says so at the step's end."""
        stored = []
        for key in keys:
            if key in self.pinned or key in self.cached:
                continue  # computed twice concurrently: the duplicate stays private
            self.pinned[key] = 1
            request.own_keys.append(key)
            request.private_blocks -= 1
            self.private_blocks -= 1
            stored.append(key)
        if stored:
            events.append(KvEvent("stored", tuple(stored)))

    def _finish(self, request: SimRequest, events: list[KvEvent]) -> None:
        """Its blocks are freed; they stay cached (output blocks too, for a follow-up turn)."""
        self.running.remove(request)
        self.finished.append(request)
        for key in request.own_keys:
            self._unpin(key)
        outputs = [
            key
            for key in request.keys[len(request.prompt) // self.config.block_size :]
            if key not in self.pinned and key not in self.cached
        ][: request.private_blocks]
        self.private_blocks -= request.private_blocks
        for key in outputs:
            self.cached[key] = None
        if outputs:
            events.append(KvEvent("stored", tuple(outputs)))

    def _pin(self, key: int) -> None:
        if key in self.pinned:
            self.pinned[key] += 1
        else:
            del self.cached[key]
            self.pinned[key] = 1

    def _unpin(self, key: int) -> None:
        count = self.pinned[key]
        if count > 1:
            self.pinned[key] = count - 1
        else:
            del self.pinned[key]
            self.cached[key] = None
            self.cached.move_to_end(key)

    def _evict(self, blocks: int, events: list[KvEvent]) -> None:
        removed = [self.cached.popitem(last=False)[0] for _ in range(min(blocks, len(self.cached)))]
        if removed:
            events.append(KvEvent("removed", tuple(removed)))

    def _emit(self, events: list[KvEvent]) -> None:
        if self.on_events is not None and events:
            self.on_events(self.name, events)
