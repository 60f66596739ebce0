"""The contract between the ingress and a replica group's leader.

The ingress renders, validates and routes with vLLM's own frontend; it submits the resulting
``EngineCoreRequest`` (prompt token ids and checked sampling parameters) to the chosen group's
leader through the leader's inbox, a ZeroMQ PUSH→PULL socket (:func:`encode_submission`, with
vLLM's own msgpack encoding of the request, as its AsyncLLM sends it to EngineCore); aborts take
the same socket, so one never overtakes its request. The leader's ``AsyncLLM`` outputs come back
over a ZeroMQ PUSH→PULL socket per (ingress replica, group): each message is a batch of
:class:`WireOutput`, every output ready at that moment for that ingress's requests, encoded
with msgpack (:func:`encode_outputs`). Requests and token streams thus skip Ray's per-call
machinery; a Ray call held open for the channel's life (``attach``) tells the ingress when the
leader dies.

Both sides import only this module from each other; it imports vLLM only inside the
converters (:func:`to_wire`, :func:`from_wire`, the request codec).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from typing import Any, Literal

import msgspec

DEFAULT_NAMESPACE = "flotilla"
"""Ray namespace of the coordinator, the leaders and the ingress unless ``cluster.namespace`` says otherwise."""


def leader_actor_name(group_name: str) -> str:
    return f"flotilla-leader-{group_name}"


class EngineErrorKind(StrEnum):
    BAD_REQUEST = "bad_request"
    ENGINE_DEAD = "engine_dead"
    INTERNAL = "internal"


class GroupEngineError(Exception):
    """Raised by a leader when the engine rejects or fails a request."""

    def __init__(self, kind: EngineErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __reduce__(self):  # keep kind/message across Ray's pickling
        return (GroupEngineError, (self.kind, self.message))


# --- outputs on the channel: vLLM's RequestOutput, typed for msgpack ----------------------------
# vLLM's RequestOutput is a plain class holding dataclasses and dicts keyed by token id, which no
# typed decoder accepts; these structs carry exactly what the OpenAI serving layer reads from it.


class WireLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int | None
    decoded_token: str | None


WirePosition = list[WireLogprob] | None
"""One position's candidates (the sampled token and the top ones); None where vLLM has None."""


class WireCompletion(msgspec.Struct, array_like=True):
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[WirePosition] | None
    finish_reason: str | None
    stop_reason: int | str | None


class WireOutput(msgspec.Struct, array_like=True):
    """One item of a channel batch: a ``RequestOutput`` of the request ``key``, or the error that ended it."""

    key: str
    """The channel's id of this attempt (not vLLM's request id, which a client may repeat)."""
    request_id: str = ""
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[WirePosition] | None = None
    outputs: list[WireCompletion] = []
    finished: bool = False
    num_cached_tokens: int | None = None
    num_cache_creation_tokens: int | None = None
    flat_logprobs: bool = False
    error_kind: EngineErrorKind | None = None
    error_message: str = ""
    prompt_as_submitted: bool = False
    """The prompt was the one the ingress submitted, left off the wire (``prompt_token_ids`` is None): on every
    streamed output of a 512-token prompt it was 1.5 kB and ~30 us of encoding and decoding per token."""

    @classmethod
    def failed(cls, key: str, error: GroupEngineError) -> WireOutput:
        return cls(key, error_kind=error.kind, error_message=error.message, finished=True)

    def error(self) -> GroupEngineError | None:
        return None if self.error_kind is None else GroupEngineError(self.error_kind, self.error_message)

    def generated_token_ids(self) -> list[int]:
        """Tokens of the first sequence in this output (for routing's bookkeeping)."""
        return self.outputs[0].token_ids if self.outputs else []


def to_wire(key: str, output: Any, submitted_prompt: Sequence[int] | None = None) -> WireOutput:
    """A vLLM ``RequestOutput`` as a channel item (in the leader). A prompt equal to ``submitted_prompt`` (the
    request's, which the ingress keeps) stays off the wire; ``from_wire`` puts it back."""
    from vllm.logprobs import FlatLogprobs

    prompt = output.prompt_token_ids
    as_submitted = prompt is not None and (prompt is submitted_prompt or prompt == submitted_prompt)
    return WireOutput(
        key,
        request_id=output.request_id,
        prompt_token_ids=None if as_submitted or prompt is None else list(prompt),
        prompt_logprobs=_positions_to_wire(output.prompt_logprobs),
        outputs=[
            WireCompletion(
                c.index,
                c.text,
                list(c.token_ids),
                c.cumulative_logprob,
                _positions_to_wire(c.logprobs),
                c.finish_reason,
                c.stop_reason,
            )
            for c in output.outputs
        ],
        finished=output.finished,
        num_cached_tokens=output.num_cached_tokens,
        num_cache_creation_tokens=output.num_cache_creation_tokens,
        flat_logprobs=isinstance(output.prompt_logprobs, FlatLogprobs)
        or any(isinstance(c.logprobs, FlatLogprobs) for c in output.outputs),
        prompt_as_submitted=as_submitted,
    )


def from_wire(item: WireOutput, submitted_prompt: list[int] | None = None) -> Any:
    """The vLLM ``RequestOutput`` a channel item carries (in the ingress), given the prompt it submitted."""
    from vllm.outputs import CompletionOutput, RequestOutput

    prompt = item.prompt_token_ids
    if item.prompt_as_submitted:
        if submitted_prompt is None:
            raise ValueError(f"output of {item.request_id!r} refers to a submitted prompt that was not given")
        prompt = submitted_prompt
    return RequestOutput(
        request_id=item.request_id,
        prompt=None,
        prompt_token_ids=prompt,
        prompt_logprobs=_positions_from_wire(item.prompt_logprobs, item.flat_logprobs),
        outputs=[
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob,
                logprobs=_positions_from_wire(c.logprobs, item.flat_logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in item.outputs
        ],
        finished=item.finished,
        num_cached_tokens=item.num_cached_tokens,
        num_cache_creation_tokens=item.num_cache_creation_tokens,
    )


def _positions_to_wire(positions: Any) -> list[WirePosition] | None:
    if positions is None:
        return None
    return [
        None
        if candidates is None
        else [WireLogprob(token_id, p.logprob, p.rank, p.decoded_token) for token_id, p in candidates.items()]
        for candidates in positions
    ]


def _positions_from_wire(positions: list[WirePosition] | None, flat: bool) -> Any:
    from vllm.logprobs import FlatLogprobs, Logprob

    if positions is None:
        return None
    restored = [
        None if candidates is None else {c.token_id: Logprob(c.logprob, c.rank, c.decoded_token) for c in candidates}
        for candidates in positions
    ]
    if not flat:
        return restored
    container = FlatLogprobs()
    container.extend(restored)
    return container


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[WireOutput])


def encode_outputs(batch: list[WireOutput]) -> bytes:
    return _encoder.encode(batch)


def decode_outputs(payload: bytes) -> list[WireOutput]:
    """Typed decoding: a malformed or foreign message raises, it never builds arbitrary objects."""
    return _decoder.decode(payload)


# --- requests into a leader's inbox: a header frame, then vLLM's own encoding of the request ----------------


class InboxHeader(msgspec.Struct, array_like=True):
    """First frame of an inbox message: a submission (its request's frames follow) or an abort."""

    kind: Literal["submit", "abort"]
    key: str
    channel_id: str = ""
    """Submissions: the ingress channel the outputs go to, and where it listens."""
    address: str = ""


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(InboxHeader)


@cache
def _request_codec() -> tuple[Any, Any]:
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)


def encode_submission(channel_id: str, address: str, key: str, request: Any) -> list[Any]:
    """Frames that submit ``request`` (an ``EngineCoreRequest``) as ``key``, outputs to the channel at ``address``."""
    encoder, _ = _request_codec()
    header = _header_encoder.encode(InboxHeader("submit", key, channel_id, address))
    return [header, *encoder.encode(request)]


def encode_abort(key: str) -> list[bytes]:
    return [_header_encoder.encode(InboxHeader("abort", key))]


def decode_header(frame: bytes | memoryview) -> InboxHeader:
    """Typed, as :func:`decode_outputs`: a foreign message raises."""
    return _header_decoder.decode(frame)


def decode_request(frames: Sequence[bytes | memoryview]) -> Any:
    """The ``EngineCoreRequest`` of a submission's frames (those after the header)."""
    _, decoder = _request_codec()
    return decoder.decode(frames)


# --- what a leader tells the coordinator, the ingress and `flotilla status` -----------------


class EnginePhase(StrEnum):
    """One group's engine bring-up, as its ``ReplicaGroup`` drives it and its leader reports it.

    Not to be confused with :class:`GroupState`, the coordinator's routing lifecycle of a group.
    """

    PLACING = "placing"  # reserving the placement group's bundles (no leader yet)
    STARTING_ENGINE = "starting_engine"  # workers, weights, KV cache
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the ingress and status need to know about a ready engine."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vllm_instance_id: str
    startup_s: float
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    inbox_endpoint: str = ""
    """Where ingress replicas submit requests and aborts (``encode_submission``); set once the engine runs."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The engine's scheduler state after its latest step (vLLM's own scheduler stats)."""

    running: int
    waiting: int
    kv_usage: float
    vllm_instance_id: str | None


@dataclass(frozen=True, slots=True)
class LeaderHealth:
    """What the coordinator's periodic check learns from a leader."""

    engine_alive: bool
    error: str | None
    unfinished_requests: int
    seconds_since_progress: float
    """Since the engine last produced output, or since it got work while idle."""


@dataclass(frozen=True, slots=True)
class LeaderDescription:
    group_name: str
    phase: EnginePhase
    error: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    rank_bundles: list[int]
    """Bundle index of rank 0, 1, …"""
    vllm_instance_id: str | None
    info: EngineInfo | None
    generation: int = 0
    """Which (re)start of the group this leader is; survives a coordinator restart."""
    executor: str = "ray"
    rank_processes: list[RankProcess] = field(default_factory=list)
    """Under the ``mp`` executor: the process serving rank 0, 1, … (Ray's ranks are actors: see the state API)."""


@dataclass(frozen=True, slots=True)
class RankProcess:
    name: str
    pid: int
    state: str


# --- group membership, published by the coordinator to every ingress replica -------------------


class GroupState(StrEnum):
    """A group's lifecycle as the coordinator drives it; only ``READY`` groups receive requests."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class FailureKind(StrEnum):
    """Why a group was restarted."""

    LEADER_DIED = "leader_died"
    ENGINE_DEAD = "engine_dead"
    WORKER_DIED = "worker_died"
    HANG = "hang"
    START_FAILED = "start_failed"
    OPERATOR = "operator"


DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(slots=True)
class DurationHistogram:
    """Cumulative observations the coordinator keeps and each ingress exports as a Prometheus histogram."""

    counts: list[int] = field(default_factory=lambda: [0] * len(DURATION_BUCKETS_S))
    count: int = 0
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(DURATION_BUCKETS_S):
            if seconds <= bound:
                self.counts[i] += 1
        self.count += 1
        self.total += seconds

    def copy(self) -> DurationHistogram:
        return DurationHistogram(list(self.counts), self.count, self.total)


@dataclass(slots=True)
class GroupSnapshot:
    """One group in a membership snapshot."""

    name: str
    state: GroupState
    generation: int
    """Incremented at every (re)start: a new generation is a new engine with an empty cache."""
    leader: Any
    """Ray ActorHandle of the group's GroupLeader; None while none is up."""
    info: EngineInfo | None
    instance_id: str | None
    detail: str
    """What the group is doing or why it is not ready, in words."""
    since: float
    """Wall-clock time the group entered ``state``."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Gang restarts so far, per reason kind."""
    last_failure: str | None = None
    recent_details: list[tuple[int, str]] = field(default_factory=list)
    """The last few ``detail`` values, numbered in order, so a progress display misses no step
    that began and ended between two of its polls."""
    gang: str = ""
    """The replica group this engine belongs to and is restarted with: its own name, or, for a DP rank
    of a wide-EP group, the group's (every rank shares state, generation, detail and restarts)."""


@dataclass(slots=True)
class GroupEvent:
    """One failure of a group and what followed; wall-clock times (``time.time()``)."""

    group: str
    reason: str
    kind: FailureKind
    last_healthy_at: float
    detected_at: float
    back_in_routing_at: float | None = None
    failed: bool = False
    """True when the restart budget ran out and the group was marked failed."""


@dataclass(frozen=True, slots=True)
class RebalanceSummary:
    duration_s: float
    balancedness_before: float
    balancedness_planned: float
    experts_moved: int
    bytes_moved: int


@dataclass(frozen=True, slots=True)
class EplbStatus:
    """An expert-parallel group's load balance and rebalances, as its EPLB controller sees them."""

    state: str
    """idle, or migrating (one layer at a time)."""
    ranks: int
    layers: int
    logical_experts: int
    physical_slots: int
    window_ticks: int
    """Samples the balancedness covers: the CPU EP runtime's ticks, or vLLM's engine steps recorded under the
    current placement (0: the last recorded load spread over this placement, what vLLM's policy planned)."""
    balancedness: float | None
    """Mean over max per-rank load in the window, all layers (vLLM's definition); None before any load."""
    balancedness_per_layer: tuple[float, ...]
    rebalances: int
    skipped_plans: int
    experts_moved_total: int
    bytes_moved_total: int
    rebalance_duration: DurationHistogram
    migrating_layer: int | None
    last_rebalance: RebalanceSummary | None
    group: str = ""
    """The EP group: a wide-EP group of vLLM engines, or the CPU EP runtime's."""
    steps_since_rebalance: int | None = None
    """vLLM's EPLB: engine steps since the last rearrangement. vLLM records load only in the last window's
    steps before the next one, so ``window_ticks`` (the steps ``balancedness`` covers) stays 0 until then."""


@dataclass(frozen=True, slots=True)
class RoutingChoice:
    """The routing policy an operator set at run time (``PUT /admin/routing``), which every ingress replica
    routes by instead of the config's; the cluster side passes it on without knowing the policies."""

    policy: str
    params: dict[str, Any]


@dataclass(slots=True)
class Membership:
    """Every group as the coordinator sees it; ``version`` grows with every change."""

    version: int
    coordinator_started_at: float
    groups: list[GroupSnapshot]
    detection: DurationHistogram = field(default_factory=DurationHistogram)
    """Time from a group's last good health check to the detected failure."""
    recovery: DurationHistogram = field(default_factory=DurationHistogram)
    """Time a failed group spent out of routing until it was ready again."""
    events: list[GroupEvent] = field(default_factory=list)
    """The latest failures and recoveries, oldest first (bounded)."""
    eplb: list[EplbStatus] = field(default_factory=list)
    """Every expert-parallel group's balance and rebalances: wide-EP groups with EPLB, the CPU EP runtime."""
    routing: RoutingChoice | None = None
    """The operator's routing policy, set at run time; None: the config's."""

    def ready(self) -> list[GroupSnapshot]:
        return [g for g in self.groups if g.state is GroupState.READY]

    def group(self, name: str) -> GroupSnapshot | None:
        return next((g for g in self.groups if g.name == name), None)


COORDINATOR_NAME = "flotilla-coordinator"
