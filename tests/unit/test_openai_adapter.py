from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.group_api import GenerateChunk
from router.openai_adapter import StreamTotals, prepare_chat, prepare_completion
from router.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from router.tokenization import PromptTokenizer

MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> PromptTokenizer:
    return PromptTokenizer(tiny_llama)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "Hello"} | fields))


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]} | fields
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def test_completion_defaults_to_16_tokens_and_greedy_settings_pass_through(tokenizer) -> None:
    prepared = prepare_completion(completion(temperature=0, stop="x", seed=3), tokenizer, MAX_LEN, "m")
    sampling = prepared.generate.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.stop, sampling.seed) == (16, 0.0, ["x"], 3)
    assert prepared.generate.prompt_token_ids == tokenizer.encode_text("Hello")
    assert prepared.generate.request_id.startswith("cmpl-")


def test_chat_without_max_tokens_may_fill_the_context(tokenizer) -> None:
    prepared = prepare_chat(chat(), tokenizer, MAX_LEN, "m")
    assert prepared.generate.sampling.max_tokens == MAX_LEN - len(prepared.generate.prompt_token_ids)
    assert (
        prepare_chat(chat(max_completion_tokens=5, max_tokens=9), tokenizer, MAX_LEN, "m").generate.sampling.max_tokens
        == 5
    )


def test_token_id_prompts_are_accepted_and_range_checked(tokenizer) -> None:
    assert prepare_completion(completion(prompt=[5, 6, 7]), tokenizer, MAX_LEN, "m").generate.prompt_token_ids == [
        5,
        6,
        7,
    ]
    with pytest.raises(OpenAIError, match="vocabulary size") as err:
        prepare_completion(completion(prompt=[5, tokenizer.vocab_size]), tokenizer, MAX_LEN, "m")
    assert err.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_tokens": MAX_LEN}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "word " * MAX_LEN}, "prompt", "context_length_exceeded"),
        ({"prompt": ""}, "prompt", None),
    ],
)
def test_length_errors(tokenizer, fields, param, code) -> None:
    with pytest.raises(OpenAIError) as err:
        prepare_completion(completion(**fields), tokenizer, MAX_LEN, "m")
    assert (err.value.status_code, err.value.param, err.value.code) == (400, param, code)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "prompt": "x", "max_tokens": "5"},
        {"model": "m", "prompt": "x", "temperature": "hot"},
        {"model": "m", "prompt": "x", "temperature": 3},
        {"model": "m", "prompt": "x", "n": 2},
        {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
        {"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
        {"model": "m", "prompt": "x", "frobnicate": True},
        {"model": "m", "prompt": ["a", "b"]},
        {"model": "m", "prompt": [-1]},
        {"model": 5, "prompt": "x"},
    ],
)
def test_invalid_completion_bodies_fail_validation(body) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json(json.dumps(body))


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
    ],
)
def test_invalid_chat_messages_fail_validation(messages) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json(json.dumps({"model": "m", "messages": messages}))


def test_text_parts_are_joined(tokenizer) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    joined = prepare_chat(chat(messages=[{"role": "user", "content": parts}]), tokenizer, MAX_LEN, "m")
    plain = prepare_chat(chat(messages=[{"role": "user", "content": "Hello"}]), tokenizer, MAX_LEN, "m")
    assert joined.generate.prompt_token_ids == plain.generate.prompt_token_ids


def test_formatters_shape_openai_objects(tokenizer) -> None:
    totals = StreamTotals()
    totals.add(GenerateChunk("ab", [1, 2], num_prompt_tokens=7, num_cached_tokens=0))
    totals.add(GenerateChunk("c", [3], num_prompt_tokens=7, num_cached_tokens=0, finish_reason="length"))
    chat_fmt = prepare_chat(chat(stream=True), tokenizer, MAX_LEN, "m").formatter
    first = chat_fmt.chunk("ab", None, first=True).model_dump()
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "ab",
    }
    assert chat_fmt.usage_chunk(totals).model_dump()["usage"]["total_tokens"] == 10
    full = (
        prepare_completion(completion(), tokenizer, MAX_LEN, "m").formatter.full("abc", "length", totals).model_dump()
    )
    assert full["object"] == "text_completion" and full["choices"][0]["text"] == "abc"
    assert full["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
