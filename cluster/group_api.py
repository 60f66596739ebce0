"""The contract between the ingress and a replica group's leader.

The ingress tokenizes, validates and routes; it submits a :class:`GenerateRequest` holding
prompt token ids to the chosen group's leader actor (``submit``, a Ray actor call). Outputs
come back over a ZeroMQ PUSH→PULL socket per (ingress replica, group): each message is a
batch of :class:`RequestOutput`, every chunk ready at that moment for that ingress's requests,
encoded with msgpack (:func:`encode_outputs`). Token streams thus skip Ray's per-object
machinery; a Ray call held open for the channel's life (``attach``) tells the ingress when the
leader dies.

Both sides import only this module from each other, and it imports nothing heavy (no vLLM,
no Ray), so the ingress stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from cluster.leader import EngineInfo

LEADER_NAMESPACE = "flotilla"


def leader_actor_name(group_name: str) -> str:
    return f"flotilla-leader-{group_name}"


@dataclass(slots=True)
class SamplingSpec:
    """Sampling parameters, already validated by the ingress (OpenAI names and units)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    stream: bool = True
    """When False the leader yields a single final chunk (fewer messages for non-streaming calls)."""


@dataclass(slots=True)
class GenerateChunk:
    """New output since the previous chunk of the same request."""

    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None


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


@dataclass(slots=True)
class RequestOutput:
    """One item of a channel batch: a chunk of ``request_id``, or the error that ended it."""

    request_id: str
    chunk: GenerateChunk | None = None
    error_kind: EngineErrorKind | None = None
    error_message: str = ""

    @classmethod
    def failed(cls, request_id: str, error: GroupEngineError) -> RequestOutput:
        return cls(request_id, error_kind=error.kind, error_message=error.message)

    def error(self) -> GroupEngineError | None:
        return None if self.error_kind is None else GroupEngineError(self.error_kind, self.error_message)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[RequestOutput])


def encode_outputs(batch: list[RequestOutput]) -> bytes:
    return _encoder.encode(batch)


def decode_outputs(payload: bytes) -> list[RequestOutput]:
    """Typed decoding: a malformed or foreign message raises, it never builds arbitrary objects."""
    return _decoder.decode(payload)


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


@dataclass(slots=True)
class GroupEvent:
    """One failure of a group and what followed; wall-clock times (``time.time()``)."""

    group: str
    reason: str
    kind: str
    """Short reason class: leader_died, engine_dead, worker_died, hang, request_failed, operator."""
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
    eplb: EplbStatus | None = None
    """The expert-parallel group's balance, when the coordinator runs one."""

    def ready(self) -> list[GroupSnapshot]:
        return [g for g in self.groups if g.state is GroupState.READY]

    def group(self, name: str) -> GroupSnapshot | None:
        return next((g for g in self.groups if g.name == name), None)


COORDINATOR_NAME = "flotilla-coordinator"
