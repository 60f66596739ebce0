"""Translation between OpenAI payloads and the group contract (``cluster.group_api``).

Inbound: a validated OpenAI request becomes a :class:`PreparedRequest` (prompt token ids and
sampling), after the checks that need the tokenizer or the context window. Outbound: a
:class:`ResponseFormatter` turns the group's chunks into OpenAI bodies and stream chunks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from cluster.group_api import GenerateChunk, GenerateRequest, SamplingSpec
from router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    bad_request,
    now,
    usage,
)
from router.tokenization import PromptTokenizer

EnvelopeT = TypeVar("EnvelopeT", CompletionResponse, ChatCompletionResponse, ChatCompletionChunk)


@dataclass(slots=True)
class PreparedRequest:
    generate: GenerateRequest
    include_usage: bool
    formatter: ResponseFormatter


def prepare_completion(
    request: CompletionRequest, tokenizer: PromptTokenizer, max_model_len: int, model_name: str
) -> PreparedRequest:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of exactly one prompt (validated by the protocol model)
    if isinstance(prompt, str):
        token_ids = tokenizer.encode_text(prompt)
    else:
        token_ids = list(prompt)  # type: ignore[arg-type]
        if max(token_ids) >= tokenizer.vocab_size:
            raise bad_request(f"prompt token ids must be below the vocabulary size {tokenizer.vocab_size}", "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return _prepare(
        request,
        request_id,
        token_ids,
        request.max_tokens,
        max_model_len,
        CompletionFormatter(request_id, model_name),
    )


def prepare_chat(
    request: ChatCompletionRequest, tokenizer: PromptTokenizer, max_model_len: int, model_name: str
) -> PreparedRequest:
    token_ids = tokenizer.encode_chat(request.messages)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    return _prepare(
        request,
        request_id,
        token_ids,
        request.requested_max_tokens,
        max_model_len,
        ChatFormatter(request_id, model_name),
    )


def _prepare(
    request: SamplingFields,
    request_id: str,
    token_ids: list[int],
    max_tokens: int | None,
    max_model_len: int,
    formatter: ResponseFormatter,
) -> PreparedRequest:
    if not token_ids:
        raise bad_request("the prompt is empty", "prompt")
    max_tokens_param = "max_completion_tokens" if isinstance(request, ChatCompletionRequest) else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
    room = max_model_len - len(token_ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = len(token_ids) + (max_tokens or 0)
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{asked} tokens ({len(token_ids)} in the prompt, {max_tokens or 0} in the completion). "
            "Please reduce the length of the prompt or completion.",
            max_tokens_param if room >= 1 else "prompt",
            code="context_length_exceeded",
        )
    sampling = SamplingSpec(
        max_tokens=max_tokens if max_tokens is not None else room,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k if request.top_k not in (None, -1) else 0,
        min_tokens=request.min_tokens,
        seed=request.seed,
        stop=request.stop_list,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        ignore_eos=request.ignore_eos,
    )
    generate = GenerateRequest(request_id, token_ids, sampling, stream=request.stream)
    return PreparedRequest(generate, request.include_usage, formatter)


@dataclass(slots=True)
class StreamTotals:
    """What a response has produced so far, for usage accounting."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, chunk: GenerateChunk) -> None:
        self.prompt_tokens = chunk.num_prompt_tokens
        self.cached_tokens = chunk.num_cached_tokens
        self.completion_tokens += len(chunk.token_ids)


class ResponseFormatter:
    """OpenAI bodies for one request; subclasses fix the object shapes."""

    def __init__(self, request_id: str, model_name: str) -> None:
        self.request_id = request_id
        self.model_name = model_name
        self.created = now()

    def full(self, text: str, finish_reason: str | None, totals: StreamTotals) -> BaseModel:
        raise NotImplementedError

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, totals: StreamTotals) -> BaseModel:
        raise NotImplementedError

    def _envelope(self, model: type[EnvelopeT], choices: list, totals: StreamTotals | None) -> EnvelopeT:
        return model(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices, usage=_usage(totals)
        )


class CompletionFormatter(ResponseFormatter):
    def full(self, text: str, finish_reason: str | None, totals: StreamTotals) -> BaseModel:
        return self._envelope(CompletionResponse, [CompletionChoice(text=text, finish_reason=finish_reason)], totals)

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> BaseModel:
        return self._envelope(CompletionResponse, [CompletionChoice(text=text, finish_reason=finish_reason)], None)

    def usage_chunk(self, totals: StreamTotals) -> BaseModel:
        return self._envelope(CompletionResponse, [], totals)


class ChatFormatter(ResponseFormatter):
    def full(self, text: str, finish_reason: str | None, totals: StreamTotals) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return self._envelope(ChatCompletionResponse, [choice], totals)

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> BaseModel:
        delta = ChatDelta(role="assistant" if first else None, content=text)
        return self._envelope(ChatCompletionChunk, [ChatChunkChoice(delta=delta, finish_reason=finish_reason)], None)

    def usage_chunk(self, totals: StreamTotals) -> BaseModel:
        return self._envelope(ChatCompletionChunk, [], totals)


def _usage(totals: StreamTotals | None):  # -> Usage | None
    if totals is None:
        return None
    return usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)
