"""Many simulated groups behind one :class:`router.routing.Router`, in virtual time.

Used to test and benchmark routing at scale: groups are :class:`SimEngine` instances, sessions
arrive closed-loop (a fixed number of sessions each sending its next turn when the previous
one finishes) or open-loop (sessions start at Poisson arrivals, as ``vllm bench serve
--request-rate`` sends them), the router sees the engines' load as they report it and, in precise
mode, their KV events. Decision latency is measured in real time around ``Router.route``.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

from flotilla.router.routing import Decision, EngineLoad, Router
from flotilla.router.sim_engine import KvEvent, SimEngine, SimEngineConfig, SimRequest


@dataclass(frozen=True, slots=True)
class Turn:
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True, slots=True)
class Session:
    """Turns sent one after another; a turn's prompt usually extends the previous turn's prompt + output."""

    turns: list[Turn]


@dataclass(slots=True)
class SimResult:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: list[float]
    makespan_s: float
    output_tokens: int
    decision_s: list[float]
    requests_per_group: dict[str, int]
    matched_blocks: int = 0
    best_matched_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def throughput_tokens_s(self) -> float:
        return self.output_tokens / max(self.makespan_s, 1e-9)


@dataclass(order=True)
class _Event:
    time_s: float
    order: int
    kind: str = field(compare=False)
    payload: object = field(compare=False, default=None)


@dataclass(slots=True)
class _StepEnd:
    engine: str
    kv_events: list[tuple[str, tuple[int, ...]]]
    first_tokens: list[SimRequest]
    finished: list[SimRequest]


class SimCluster:
    def __init__(self, router: Router, groups: int, config: SimEngineConfig, precise: bool = True) -> None:
        self.router = router
        self.config = config
        self.precise = precise
        self.engines = {
            f"sim-{i:04d}": SimEngine(f"sim-{i:04d}", config, self._on_events if precise else None)
            for i in range(groups)
        }
        for name in self.engines:
            router.add_group(name, config.num_blocks)
            router.index.set_precise(name, precise)
        self._queue: list[_Event] = []
        self._order = itertools.count()
        self._busy: set[str] = set()
        self._changed: set[str] = set(self.engines)  # engines whose load the router has not seen yet
        self._kv_events: list[tuple[str, tuple[int, ...]]] = []  # the running step's, delivered at its end
        self.now_s = 0.0
        router.use_clock(lambda: self.now_s)  # virtual time: what the router times (prefill pace) is simulated

    def run(
        self, sessions: list[Session], concurrency: int, request_rate: float | None = None, seed: int = 0
    ) -> SimResult:
        """Serve every session, at most ``concurrency`` sessions at once; returns what it measured.

        Closed loop (``request_rate`` None): every session is there from the start and the next one starts when
        one ends. Open loop: sessions arrive at ``request_rate`` per second (exponential gaps drawn from ``seed``)
        and wait for a free slot where ``concurrency`` are active; a request's TTFT counts from when it is sent.
        """
        arrived: deque[Session] = deque()  # sessions that arrived and wait for a slot
        active: dict[str, tuple[Session, int]] = {}
        decisions: dict[str, Decision] = {}
        result = SimResult(0, 0, 0, [], 0.0, 0, [], {name: 0 for name in self.engines})
        ids = itertools.count()
        now = self.now_s = 0.0

        def submit(session: Session, turn_index: int, at_s: float) -> None:
            request_id = f"r{next(ids)}"
            turn = session.turns[turn_index]
            active[request_id] = (session, turn_index)
            self._report_load()
            started = time.perf_counter()
            decision = self.router.route(request_id, turn.prompt)
            result.decision_s.append(time.perf_counter() - started)
            decisions[request_id] = decision
            result.matched_blocks += decision.matched_blocks
            result.best_matched_blocks += decision.best_matched_blocks
            engine = self.engines[decision.group]
            engine.add_request(SimRequest(request_id, turn.prompt, turn.output, at_s))
            self._changed.add(engine.name)
            result.requests_per_group[engine.name] += 1
            self._wake(engine, at_s)

        if request_rate is None:
            arrived.extend(sessions)
            while arrived and len(active) < concurrency:
                submit(arrived.popleft(), 0, now)
        else:
            gaps = random.Random(seed)
            at_s = 0.0
            for session in sessions:
                heapq.heappush(self._queue, _Event(at_s, next(self._order), "arrival", session))
                at_s += gaps.expovariate(request_rate)
        while self._queue:
            event = heapq.heappop(self._queue)
            now = self.now_s = event.time_s
            if event.kind == "step":
                self._step(self.engines[str(event.payload)], now)
                continue
            if event.kind == "arrival":
                assert isinstance(event.payload, Session)
                arrived.append(event.payload)
                if len(active) < concurrency:
                    submit(arrived.popleft(), 0, now)
                continue
            # A step's end: what it produced becomes visible to the router, and finished sessions send their next
            # turn, at this time and not at the step's start (the step's work is computed when it starts).
            step_end = event.payload
            assert isinstance(step_end, _StepEnd)
            for kind, keys in step_end.kv_events:
                if kind == "stored":
                    self.router.index.record_stored(step_end.engine, keys)
                else:
                    self.router.index.record_removed(step_end.engine, keys)
            for request in step_end.first_tokens:
                decision = decisions.get(request.request_id)
                if decision is not None and not decision.first_token_seen:
                    self.router.first_token(decision)
            for request in step_end.finished:
                self.router.finished(decisions.pop(request.request_id), request.output)
                self._account(result, request)
                session, turn_index = active.pop(request.request_id)
                if turn_index + 1 < len(session.turns):
                    submit(session, turn_index + 1, now)
                elif arrived:
                    submit(arrived.popleft(), 0, now)
            result.makespan_s = max(result.makespan_s, now)
        return result

    def _step(self, engine: SimEngine, now: float) -> None:
        """Run ``engine``'s step starting at ``now``; its results arrive at its end, just before its next step."""
        self._busy.discard(engine.name)
        finished_before = len(engine.finished)
        no_token_yet = [request for request in [*engine.running, *engine.waiting] if request.first_token_s is None]
        self._kv_events = []
        duration = engine.step(now)
        self._changed.add(engine.name)
        done = engine.finished[finished_before:]
        first_tokens = [request for request in no_token_yet if request.first_token_s is not None]
        if duration > 0 or self._kv_events:
            step_end = _StepEnd(engine.name, self._kv_events, first_tokens, done)
            heapq.heappush(self._queue, _Event(now + duration, next(self._order), "step_end", step_end))
        if duration > 0:
            self._schedule(engine, now + duration)
        elif engine.has_work():  # blocked on KV space with nothing running cannot happen; guard anyway
            raise RuntimeError(f"{engine.name} cannot make progress")

    def _account(self, result: SimResult, request: SimRequest) -> None:
        result.requests += 1
        result.prompt_tokens += len(request.prompt)
        result.cached_tokens += request.cached_tokens
        result.output_tokens += len(request.output)
        assert request.first_token_s is not None
        result.ttft_s.append(request.first_token_s - request.arrival_s)

    def _wake(self, engine: SimEngine, at_s: float) -> None:
        if engine.name not in self._busy:
            self._schedule(engine, at_s)

    def _schedule(self, engine: SimEngine, at_s: float) -> None:
        self._busy.add(engine.name)
        heapq.heappush(self._queue, _Event(at_s, next(self._order), "step", engine.name))

    def _report_load(self) -> None:
        for name in self._changed:
            engine = self.engines[name]
            self.router.update_engine_load(name, EngineLoad(len(engine.running), len(engine.waiting), engine.kv_usage))
        self._changed.clear()

    def _on_events(self, group: str, events: list[KvEvent]) -> None:
        self._kv_events.extend((event.kind, event.keys) for event in events)
