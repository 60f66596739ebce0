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

import msgspec

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
