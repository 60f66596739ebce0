"""The same requests to vLLM's own OpenAI server and to `flotilla serve`: same status codes, same greedy tokens.

Both serve tiny-llama with the same engine settings (float32, 512 MiB KV cache, prefix caching,
eager execution without the warm-up pass) and the same serving flags (the model's tool-capable chat
template, vLLM's `llama3_json` tool parser, prompt token details). vLLM runs first and is
stopped, then Flotilla (two groups), so the two never share the machine's cores. Requests go
one at a time: batch composition cannot change a greedy token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import Server, flotilla_serve, vllm_serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
MODEL = "tiny-llama"
API_KEY = "parity-test-key"
# A random-weight model fills JSON with whitespace until max_tokens; the grammar then forbids it.
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
SERVING_FLAGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "llama3_json",
    "--enable-prompt-tokens-details",
    "--structured-outputs-config",
    json.dumps(STRUCTURED_OUTPUTS),
    "--api-key",
    API_KEY,
]
BAN_WHITESPACE = "ban-whitespace"
"""A logit_bias placeholder: -100 on every whitespace-only token (a tool call's own JSON allows whitespace)."""
VOLATILE_KEYS = frozenset({"id", "created", "created_at", "system_fingerprint"})
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "enum": [20, 30, 40]}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Tell me about the river"}]


@dataclass(frozen=True)
class Shape:
    name: str
    path: str
    body: Any
    greedy: bool = False
    """Compare the generated token ids too (the body asks for temperature 0 and return_token_ids)."""
    method: str = "POST"


@dataclass
class Answer:
    status: int
    body: Any
    events: list[Any] = field(default_factory=list)
    """Parsed SSE events of a stream (without [DONE])."""
    done: bool = False


def cmpl(name: str, greedy: bool = True, **fields: Any) -> Shape:
    body = {"model": MODEL, "prompt": "The river and the mountain", "max_tokens": 8} | fields
    if greedy:
        body |= {"temperature": 0, "return_token_ids": True}
    return Shape(name, "/v1/completions", body, greedy)


def chat(name: str, greedy: bool = True, **fields: Any) -> Shape:
    body = {"model": MODEL, "messages": USER, "max_tokens": 8} | fields
    if greedy:
        body |= {"temperature": 0, "return_token_ids": True}
    return Shape(name, "/v1/chat/completions", body, greedy)


SHAPES = [
    # completions
    cmpl("completion"),
    cmpl("completion_stream", stream=True, stream_options={"include_usage": True}),
    cmpl("completion_n3_seeded", greedy=False, n=3, temperature=0.9, seed=7),
    cmpl("completion_logprobs", logprobs=3),
    cmpl("completion_echo_logprobs", greedy=False, temperature=0, echo=True, logprobs=2, max_tokens=4),
    cmpl("completion_prompt_list", prompt=["The river", "A mountain at dawn"]),
    cmpl("completion_token_ids", prompt=[17, 250, 33, 980, 5, 61]),
    cmpl("completion_token_id_lists", prompt=[[17, 250, 33], [980, 5, 61, 402]]),
    cmpl("completion_min_p", greedy=False, temperature=0.8, min_p=0.2, seed=3),
    cmpl("completion_stop_token_ids", stop_token_ids=[5, 9, 11]),
    cmpl("completion_logit_bias", logit_bias={"100": 100, "101": -100}),
    cmpl("completion_stop_strings", stop=[" the", "."], max_tokens=16),
    cmpl("completion_top_k_repetition", top_k=5, repetition_penalty=1.3, seed=1, greedy=False),
    cmpl("completion_min_tokens_ignore_eos", min_tokens=4, ignore_eos=True),
    cmpl("completion_include_stop_str", stop=["a"], include_stop_str_in_output=True, max_tokens=16),
    cmpl("completion_explicit_nulls", stop=None, seed=None, logprobs=None, user=None, suffix=None, n=None),
    cmpl("completion_stop_empty_string", stop=""),
    cmpl("completion_min_tokens_above_max", min_tokens=10, max_tokens=2),
    cmpl("completion_max_tokens_too_large", max_tokens=10**7),
    cmpl("completion_prompt_too_long", prompt="word " * 3000),
    cmpl("completion_negative_max_tokens", max_tokens=-1),
    cmpl("completion_wrong_type", max_tokens="ten"),
    cmpl("completion_unknown_model", model="gpt-9"),
    cmpl("completion_logprobs_too_many", logprobs=100),
    cmpl("completion_temperature_negative", temperature=-1.0, greedy=False),
    Shape("completion_bad_json", "/v1/completions", b'{"model": "tiny-llama", "prompt": '),
    Shape("completion_not_an_object", "/v1/completions", b"[1, 2]"),
    # chat completions
    chat("chat"),
    chat("chat_stream", stream=True, stream_options={"include_usage": True}),
    chat("chat_n3_seeded", greedy=False, n=3, temperature=0.9, seed=11),
    chat("chat_logprobs", logprobs=True, top_logprobs=3),
    chat("chat_max_completion_tokens", max_completion_tokens=5),
    chat(
        "chat_system_developer_named",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in one line."},
            {"role": "user", "content": "Hello", "name": "alice"},
        ],
    ),
    chat(
        "chat_text_parts",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
    ),
    chat(
        "chat_explicit_nulls",
        temperature=0,
        stop=None,
        seed=None,
        tools=None,
        tool_choice=None,
        logprobs=None,
        user=None,
    ),
    chat("chat_benign_openai_fields", store=False, metadata={"team": "flotilla"}, parallel_tool_calls=True),
    chat("chat_template_kwargs", chat_template_kwargs={"add_generation_prompt": True}),
    chat(
        "chat_continue_final_message",
        messages=USER + [{"role": "assistant", "content": "The river is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    chat("chat_json_object", response_format={"type": "json_object"}, max_tokens=40),
    chat(
        "chat_json_schema",
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
        max_tokens=60,
    ),
    chat(
        "chat_named_tool_choice",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        logit_bias=BAN_WHITESPACE,
        max_tokens=60,
    ),
    chat("chat_tools_auto", tools=[WEATHER_TOOL], tool_choice="auto"),
    chat("chat_stop", stop=["\n"], max_tokens=16),
    chat("chat_stop_empty_string", stop=""),
    chat("chat_empty_messages", messages=[]),
    chat("chat_missing_messages", messages=None),
    chat("chat_missing_content", messages=[{"role": "user"}]),
    chat("chat_unknown_role", messages=[{"role": "wizard", "content": "x"}]),
    chat("chat_unknown_model", model="gpt-9"),
    chat("chat_min_tokens_above_max", min_tokens=10, max_tokens=2),
    chat(
        "chat_tool_choice_unknown_function",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "nope"}},
    ),
    # other routes
    Shape("models", "/v1/models", None, method="GET"),
    Shape("version", "/version", None, method="GET"),
    Shape("tokenize_prompt", "/tokenize", {"model": MODEL, "prompt": "The river 42."}),
    Shape("tokenize_chat", "/tokenize", {"model": MODEL, "messages": USER, "add_generation_prompt": True}),
    Shape("detokenize", "/detokenize", {"model": MODEL, "tokens": [17, 250, 33, 980]}),
    Shape(
        "responses",
        "/v1/responses",
        {"model": MODEL, "input": "Tell me about the river", "max_output_tokens": 8, "temperature": 0},
    ),
]


def ask(client: httpx.Client, shape: Shape, whitespace_ids: list[int]) -> Answer:
    if shape.method == "GET":
        response = client.get(shape.path)
        return Answer(response.status_code, response.json())
    body = shape.body
    if isinstance(body, dict) and body.get("logit_bias") == BAN_WHITESPACE:
        body = body | {"logit_bias": {str(token): -100 for token in whitespace_ids}}
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    is_stream = isinstance(body, dict) and body.get("stream")
    with client.stream("POST", shape.path, headers={"content-type": "application/json"}, **kwargs) as response:
        if not is_stream or response.status_code != 200:
            response.read()
            return Answer(response.status_code, response.json())
        answer = Answer(response.status_code, None)
        for line in response.iter_lines():
            if line == "data: [DONE]":
                answer.done = True
            elif line.startswith("data: "):
                answer.events.append(json.loads(line.removeprefix("data: ")))
        return answer


def ask_all(url: str, model: Path) -> dict[str, Answer]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    whitespace_ids = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()]
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as client:
        ask(client, cmpl("warm_up"), whitespace_ids)
        answers = {shape.name: ask(client, shape, whitespace_ids) for shape in SHAPES}
        tokens = answers["tokenize_prompt"].body["tokens"]
        round_trip = Shape("round_trip", "/detokenize", {"model": MODEL, "tokens": tokens})
        answers["round_trip"] = ask(client, round_trip, whitespace_ids)
        return answers


@pytest.fixture(scope="module")
def vllm_answers(tiny_llama: Path) -> dict[str, Answer]:
    with vllm_serve(tiny_llama, MODEL, SERVING_FLAGS) as url:
        return ask_all(url, tiny_llama)


@pytest.fixture(scope="module")
def flotilla(vllm_answers, tiny_llama: Path, tmp_path_factory) -> Iterator[Server]:
    """Started after vLLM's server has stopped (``vllm_answers``)."""
    config = tmp_path_factory.mktemp("parity") / "parity.yaml"
    config.write_text(
        json.dumps(
            {
                "model": str(tiny_llama),
                "served_model_name": MODEL,
                "groups": 2,
                "engine_args": {"structured_outputs_config": STRUCTURED_OUTPUTS},
                "serving": {
                    "enable_auto_tool_choice": True,
                    "tool_call_parser": "llama3_json",
                    "api_keys_env": "PARITY_API_KEYS",
                },
            }
        )
    )
    with flotilla_serve(str(config), env={"PARITY_API_KEYS": f"other-key, {API_KEY}"}) as server:
        yield server


@pytest.fixture(scope="module")
def flotilla_answers(flotilla: Server, tiny_llama: Path) -> dict[str, Answer]:
    return ask_all(flotilla.url, tiny_llama)


def normalized(value: Any) -> Any:
    """``value`` without the fields that differ on every call (ids, timestamps, build fingerprints)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def generated_token_ids(answer: Answer) -> list[list[int]]:
    """Per choice, the generated token ids (from return_token_ids; streams concatenated)."""
    if answer.events:
        per_choice: dict[int, list[int]] = {}
        for event in answer.events:
            for choice in event.get("choices", []):
                per_choice.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
        return [per_choice[i] for i in sorted(per_choice)]
    return [choice["token_ids"] for choice in answer.body["choices"]]


def test_enough_request_shapes() -> None:
    assert len(SHAPES) >= 40


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_same_answer_as_vllm(shape: Shape, vllm_answers, flotilla_answers) -> None:
    """Same status; for successes the same body (or stream of events) but for ids and timestamps."""
    ours, theirs = flotilla_answers[shape.name], vllm_answers[shape.name]
    assert ours.status == theirs.status, (ours.body, theirs.body)
    if ours.status != 200:
        assert set(ours.body["error"]) >= {"message", "type", "code"}
        return
    assert normalized(ours.body) == normalized(theirs.body)
    assert normalized(ours.events) == normalized(theirs.events)
    assert ours.done == theirs.done
    if shape.greedy:
        assert all(generated_token_ids(ours))


CHECKS: dict[str, Callable[[Answer], None]] = {}


def check(name: str) -> Callable[[Callable[[Answer], None]], Callable[[Answer], None]]:
    def register(fn: Callable[[Answer], None]) -> Callable[[Answer], None]:
        CHECKS[name] = fn
        return fn

    return register


@check("completion_n3_seeded")
def _three_choices(answer: Answer) -> None:
    assert sorted(c["index"] for c in answer.body["choices"]) == [0, 1, 2]


@check("completion_echo_logprobs")
def _echo(answer: Answer) -> None:
    choice = answer.body["choices"][0]
    assert choice["text"].startswith("The river and the mountain")
    assert len(choice["logprobs"]["tokens"]) > 4


@check("chat_logprobs")
def _chat_logprobs(answer: Answer) -> None:
    content = answer.body["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(len(t["top_logprobs"]) == 3 for t in content)


@check("chat_json_schema")
def _schema(answer: Answer) -> None:
    import jsonschema

    jsonschema.validate(json.loads(answer.body["choices"][0]["message"]["content"]), PERSON_SCHEMA)


@check("chat_named_tool_choice")
def _tool_call(answer: Answer) -> None:
    import jsonschema

    (call,) = answer.body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


@check("round_trip")
def _round_trip(answer: Answer) -> None:
    assert answer.body["prompt"] == "The river 42."


@check("completion_prompt_list")
def _two_prompts(answer: Answer) -> None:
    assert len(answer.body["choices"]) == 2


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_flotilla_answer_is_right(name: str, flotilla_answers) -> None:
    answer = flotilla_answers[name]
    assert answer.status == 200, answer.body
    CHECKS[name](answer)


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")]
)
def test_api_paths_need_a_key(flotilla: Server, method: str, path: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        response = httpx.request(method, f"{flotilla.url}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == 401 and error["message"] and error["type"]
    for key in (API_KEY, "other-key"):
        response = httpx.request(
            method, f"{flotilla.url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
        )
        assert response.status_code == 200, response.text


def test_health_and_metrics_stay_open(flotilla: Server) -> None:
    assert httpx.get(f"{flotilla.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{flotilla.url}/metrics", timeout=10).status_code == 200
    unauthorized = [
        sample
        for family in text_string_to_metric_families(flotilla.metrics())
        for sample in family.samples
        if sample.name == "flotilla_requests_total" and sample.labels.get("status") == "401"
    ]
    assert "completions" in {s.labels["endpoint"] for s in unauthorized}
