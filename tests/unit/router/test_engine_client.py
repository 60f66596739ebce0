"""The routed engine client: vLLM's seam pinned, outputs carried intact, failover before the first output."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError, RetryableRequestError, VLLMValidationError
from vllm.logprobs import FlatLogprobs, Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from flotilla.cluster.contract import (
    EngineErrorKind,
    GroupEngineError,
    WireOutput,
    decode_outputs,
    encode_outputs,
    from_wire,
    to_wire,
)
from flotilla.cluster.engine import EngineSpec
from flotilla.router.engine_client import RoutedEngineClient
from flotilla.router.metrics import IngressMetrics
from flotilla.router.policies import make_policy
from flotilla.router.routing import Decision, NoRoutableGroup, Router
from flotilla.router.settings import IngressSettings

# The signature RoutedEngineClient.generate was written against (vLLM 0.32.0). When vLLM changes
# it, this test names the difference: update RoutedEngineClient.generate, then this list.
PINNED_GENERATE_PARAMETERS = [
    "self",
    "prompt",
    "sampling_params",
    "request_id",
    "prompt_text",
    "lora_request",
    "tokenization_kwargs",
    "trace_headers",
    "priority",
    "data_parallel_rank",
    "session_id",
    "kv_hints",
    "reasoning_ended",
    "reasoning_parser_kwargs",
]


def test_vllm_engine_client_generate_is_the_one_we_implement() -> None:
    theirs = list(inspect.signature(EngineClient.generate).parameters)
    assert theirs == PINNED_GENERATE_PARAMETERS, (
        "vLLM's EngineClient.generate changed; adapt router.engine_client.RoutedEngineClient.generate. "
        f"added: {sorted(set(theirs) - set(PINNED_GENERATE_PARAMETERS))}, "
        f"removed: {sorted(set(PINNED_GENERATE_PARAMETERS) - set(theirs))}"
    )
    assert list(inspect.signature(RoutedEngineClient.generate).parameters) == theirs


def test_every_abstract_method_is_implemented_with_vllms_parameters() -> None:
    assert not RoutedEngineClient.__abstractmethods__
    for name in EngineClient.__abstractmethods__:
        ours = getattr(RoutedEngineClient, name)
        if isinstance(ours, property):
            continue
        theirs = inspect.signature(getattr(EngineClient, name)).parameters
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(ours).parameters.values())
        missing = set(theirs) - set(inspect.signature(ours).parameters) - {"args", "kwargs"}
        assert accepts_any or not missing, f"{name} lacks {missing}"


# --- the channel format --------------------------------------------------------------------------


def request_output(flat: bool) -> RequestOutput:
    candidates = {7: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "b")}
    sample: Any = FlatLogprobs() if flat else []
    prompt: Any = FlatLogprobs() if flat else []
    for position in (candidates, {9: Logprob(-0.1, 1, "b")}):
        sample.append(position)
    for position in (None, candidates):
        prompt.append(position)
    return RequestOutput(
        request_id="cmpl-1-0",
        prompt=None,
        prompt_token_ids=[3, 4, 5],
        prompt_logprobs=prompt,
        outputs=[
            CompletionOutput(0, "ab", [7, 9], -2.0, sample, finish_reason="stop", stop_reason=9),
            CompletionOutput(1, "b", [9], None, None),
        ],
        finished=True,
        num_cached_tokens=128,
        num_cache_creation_tokens=256,
    )


@pytest.mark.parametrize("flat", [False, True])
def test_a_request_output_crosses_the_channel_intact(flat: bool) -> None:
    sent = request_output(flat)
    (item,) = decode_outputs(encode_outputs([to_wire("k1", sent)]))
    received = from_wire(item)
    assert item.key == "k1" and item.generated_token_ids() == [7, 9]
    for attr in ("request_id", "prompt_token_ids", "finished", "num_cached_tokens", "num_cache_creation_tokens"):
        assert getattr(received, attr) == getattr(sent, attr), attr
    assert type(received.prompt_logprobs) is type(sent.prompt_logprobs)
    assert list(received.prompt_logprobs) == list(sent.prompt_logprobs)
    for got, want in zip(received.outputs, sent.outputs, strict=True):
        for attr in ("index", "text", "token_ids", "cumulative_logprob", "finish_reason", "stop_reason"):
            assert getattr(got, attr) == getattr(want, attr), attr
        assert (got.logprobs is None) == (want.logprobs is None)
        if want.logprobs is not None:
            assert list(got.logprobs) == list(want.logprobs)


def test_the_submitted_prompt_stays_off_the_wire_and_comes_back_at_the_ingress() -> None:
    sent = request_output(flat=False)
    submitted = [3, 4, 5]
    (item,) = decode_outputs(encode_outputs([to_wire("k1", sent, list(submitted))]))
    assert item.prompt_token_ids is None and item.prompt_as_submitted
    assert from_wire(item, submitted).prompt_token_ids == submitted
    with pytest.raises(ValueError, match="submitted prompt"):
        from_wire(item)
    (other,) = decode_outputs(encode_outputs([to_wire("k1", sent, [3, 4])]))  # not the one submitted: carried
    assert other.prompt_token_ids == [3, 4, 5] and not other.prompt_as_submitted
    assert from_wire(other, [3, 4]).prompt_token_ids == [3, 4, 5]


def test_an_error_crosses_the_channel_as_a_typed_error() -> None:
    (item,) = decode_outputs(encode_outputs([WireOutput.failed("k", GroupEngineError(EngineErrorKind.INTERNAL, "x"))]))
    error = item.error()
    assert item.finished and error is not None and (error.kind, error.message) == (EngineErrorKind.INTERNAL, "x")


def test_a_foreign_message_is_refused() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        decode_outputs(msgspec.msgpack.encode([{"key": 1, "outputs": "not a list"}]))


async def test_a_request_crosses_the_inbox_intact_and_its_abort_follows_it(frontend, monkeypatch) -> None:
    """The real pair: the ingress's GroupChannel submits to a leader's RequestInbox, outputs come back;
    closing the channel cancels its attach call, which tells the leader to drop it."""
    from types import SimpleNamespace

    import msgspec
    from vllm.v1.engine.input_processor import InputProcessor

    from flotilla.cluster.output_channel import OutputChannel
    from flotilla.cluster.request_inbox import RequestInbox
    from flotilla.router.group_channel import GroupChannel

    config, renderer = frontend
    params = SamplingParams(max_tokens=4, temperature=0.5, stop=["x"], output_kind=RequestOutputKind.DELTA)
    sent = InputProcessor(config, renderer).process_inputs("cmpl-1", PROMPT, params, supported_tasks=("generate",))
    arrived: list[tuple[str, str, Any]] = []
    channels: dict[str, OutputChannel] = {}

    def submit(header: Any, request: Any) -> None:
        arrived.append(("submit", header.key, request))
        channel = channels.setdefault(header.channel_id, OutputChannel(header.channel_id, header.address))
        item = output([8], False) if header.key == "k2" else output([8, 9], True)
        channel.put(msgspec.structs.replace(item, key=header.key))

    inbox = RequestInbox("127.0.0.1", submit, lambda key: arrived.append(("abort", key, None)))
    attach_calls: list[asyncio.Future[None]] = []

    def attach(*args: Any) -> asyncio.Future[None]:  # a live leader: its attach call returns when the channel ends
        attach_calls.append(asyncio.get_running_loop().create_future())
        return attach_calls[-1]

    cancelled_calls: list[Any] = []
    attach_cancelled = asyncio.Event()

    def cancel(ref: Any) -> None:  # stands in for ray.cancel, which takes only Ray object refs
        cancelled_calls.append(ref)
        attach_cancelled.set()

    monkeypatch.setattr("flotilla.router.group_channel.ray.cancel", cancel)
    ingress = GroupChannel(SimpleNamespace(attach=SimpleNamespace(remote=attach)), "127.0.0.1", inbox.endpoint)
    try:
        finished = [item async for item in ingress.stream(sent, "k1")]
        assert [item.generated_token_ids() for item in finished] == [[8, 9]]
        kind, key, received = arrived[0]
        assert (kind, key) == ("submit", "k1")
        for attr in ("request_id", "prompt_token_ids", "arrival_time"):
            assert getattr(received, attr) == getattr(sent, attr), attr
        for attr in ("max_tokens", "temperature", "stop", "output_kind"):
            assert getattr(received.sampling_params, attr) == getattr(sent.sampling_params, attr), attr

        left_early = ingress.stream(sent, "k2")
        await anext(left_early)
        await left_early.aclose()  # the caller went away: the group is told to stop k2, after k2 itself
        for _ in range(100):
            if len(arrived) == 3:
                break
            await asyncio.sleep(0.01)
        assert [(kind, key) for kind, key, _ in arrived[1:]] == [("submit", "k2"), ("abort", "k2")]

        ingress.close()
        await asyncio.wait_for(attach_cancelled.wait(), timeout=10)
        assert cancelled_calls == attach_calls and len(attach_calls) == 1
    finally:
        ingress.close()
        inbox.close()
        for channel in channels.values():
            channel.close()


# --- routing, failover and errors, over scripted groups -------------------------------------------------


@dataclass(eq=False)  # hashed by identity, as the real GroupChannel
class ScriptedChannel:
    """A group's channel that fails with ``error`` or yields ``outputs``."""

    outputs: list[WireOutput] = field(default_factory=list)
    error: BaseException | None = None
    calls: int = 0

    async def stream(self, request: Any, key: str) -> AsyncGenerator[WireOutput, None]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        for output in self.outputs:
            await asyncio.sleep(0)
            yield output


@dataclass
class FakeMember:
    name: str
    channel: ScriptedChannel
    leader: Any = None
    gang: str = ""


class FakeDirectory:
    """GroupDirectory's request-path surface over a real Router, without Ray."""

    def __init__(self, members: dict[str, FakeMember]) -> None:
        self.router = Router(make_policy("round_robin"), block_size=16)
        self.members = members
        self.reported: list[str] = []
        self.finished_decisions: list[tuple[str, list[int]]] = []
        for name in members:
            self.router.add_group(name, 1000)

    def ensure_started(self) -> None:
        pass

    def route(self, request_id: str, tokens: list[int], exclude: frozenset[str]) -> tuple[Decision, FakeMember]:
        decision = self.router.route(request_id, tokens, exclude)
        return decision, self.members[decision.group]

    def first_token(self, decision: Decision) -> None:
        self.router.first_token(decision)

    def finished(self, decision: Decision, output: list[int]) -> None:
        self.router.finished(decision, output)
        self.finished_decisions.append((decision.group, output))

    def report_failure(self, member: FakeMember, message: str) -> None:
        self.reported.append(member.name)

    def gang_of(self, member: FakeMember) -> set[str]:
        return {m.name for m in self.members.values() if member.gang and m.gang == member.gang} | {member.name}


def output(tokens: list[int], finished: bool) -> WireOutput:
    sent = RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, "t", tokens, None, None)], finished)
    if finished:
        sent.outputs[0].finish_reason = "length"
    return to_wire("k", sent)


@pytest.fixture(scope="module")
def frontend(tiny_llama: Path):
    from vllm.renderers import renderer_from_config

    from flotilla.router.frontend import frontend_config

    spec = EngineSpec(str(tiny_llama), "tiny-llama", 1, 1)
    settings = IngressSettings(engine=spec, max_model_len=256, block_size=16)
    config = frontend_config(settings)
    return config, renderer_from_config(config)


def client_over(
    frontend, channels: dict[str, ScriptedChannel], max_attempts: int = 3, gangs: dict[str, str] | None = None
) -> RoutedEngineClient:
    config, renderer = frontend
    members = {name: FakeMember(name, channel, gang=(gangs or {}).get(name, "")) for name, channel in channels.items()}
    return RoutedEngineClient(config, renderer, FakeDirectory(members), IngressMetrics(), max_attempts)  # type: ignore[arg-type]


def stream_params(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA, **kw)


PROMPT = {"type": "token", "prompt_token_ids": [5, 6, 7]}


async def collect(generator: AsyncGenerator[RequestOutput, None]) -> list[RequestOutput]:
    return [item async for item in generator]


async def test_a_group_failing_before_any_output_is_retried_on_another(frontend) -> None:
    dead = GroupEngineError(EngineErrorKind.ENGINE_DEAD, "worker died")
    channels = {"g0": ScriptedChannel(error=dead), "g1": ScriptedChannel([output([8], False), output([9], True)])}
    client = client_over(frontend, channels)
    outputs = await collect(client.generate(PROMPT, stream_params(), "r"))
    assert [o.outputs[0].token_ids for o in outputs] == [[8], [9]]
    assert client.directory.reported == ["g0"]  # type: ignore[attr-defined]
    assert client.stats.requests_retried.labels("engine_dead")._value.get() == 1
    assert client.directory.finished_decisions == [("g0", []), ("g1", [8, 9])]  # type: ignore[attr-defined]
    assert client.directory.router.view("g1").in_flight == 0


async def test_a_failed_dp_rank_takes_its_ep_group_out_of_the_retry(frontend) -> None:
    """A DP rank that dies stalls every rank of its EP group: the retry goes to another group at once."""
    dead = GroupEngineError(EngineErrorKind.ENGINE_DEAD, "rank died")
    channels = {
        "ep0-dp0": ScriptedChannel(error=dead),
        "ep0-dp1": ScriptedChannel(error=dead),
        "ep1-dp0": ScriptedChannel([output([8], True)]),
    }
    gangs = {"ep0-dp0": "ep0", "ep0-dp1": "ep0", "ep1-dp0": "ep1"}
    client = client_over(frontend, channels, max_attempts=2, gangs=gangs)
    outputs = await collect(client.generate(PROMPT, stream_params(), "r"))  # round robin: ep0-dp0 first
    assert [o.outputs[0].token_ids for o in outputs] == [[8]]
    assert channels["ep0-dp1"].calls == 0 and client.directory.reported == ["ep0-dp0"]  # type: ignore[attr-defined]


async def test_a_failure_after_output_reached_the_caller_is_not_retried(frontend) -> None:
    class CutChannel(ScriptedChannel):
        async def stream(self, request: Any, key: str) -> AsyncGenerator[WireOutput, None]:
            self.calls += 1
            yield output([8], False)
            raise GroupEngineError(EngineErrorKind.ENGINE_DEAD, "cut")

    channels = {"g0": CutChannel(), "g1": CutChannel()}
    client = client_over(frontend, channels)
    received = []
    with pytest.raises(RetryableRequestError, match="cut"):
        async for item in client.generate(PROMPT, stream_params(), "r"):
            received.append(item)
    assert len(received) == 1 and sum(c.calls for c in channels.values()) == 1


async def test_fewer_groups_than_attempts_all_failing_end_in_the_last_failure(frontend) -> None:
    failing = {
        f"g{i}": ScriptedChannel(error=GroupEngineError(EngineErrorKind.INTERNAL, f"boom {i}")) for i in range(2)
    }
    client = client_over(frontend, failing, max_attempts=3)
    with pytest.raises(RetryableRequestError, match="boom"):
        await collect(client.generate(PROMPT, stream_params(), "r"))
    assert [c.calls for c in failing.values()] == [1, 1]


async def test_every_group_failing_ends_in_a_retryable_error_after_max_attempts(frontend) -> None:
    failing = {f"g{i}": ScriptedChannel(error=GroupEngineError(EngineErrorKind.INTERNAL, "boom")) for i in range(4)}
    client = client_over(frontend, failing, max_attempts=3)
    with pytest.raises(RetryableRequestError, match="boom"):
        await collect(client.generate(PROMPT, stream_params(), "r"))
    assert sum(c.calls for c in failing.values()) == 3


async def test_a_group_rejecting_the_request_is_a_client_error_without_retry(frontend) -> None:
    bad = GroupEngineError(EngineErrorKind.BAD_REQUEST, "grammar does not compile")
    channels = {"g0": ScriptedChannel(error=bad), "g1": ScriptedChannel(error=bad)}
    client = client_over(frontend, channels)
    with pytest.raises(VLLMValidationError, match="grammar"):
        await collect(client.generate(PROMPT, stream_params(), "r"))
    assert sum(c.calls for c in channels.values()) == 1


def test_invalid_parameters_fail_before_any_group_is_asked(frontend) -> None:
    channels = {"g0": ScriptedChannel([output([1], True)])}
    client = client_over(frontend, channels)
    too_long = {"type": "token", "prompt_token_ids": list(range(300))}  # max_model_len is 256
    with pytest.raises(VLLMValidationError):
        client.generate(too_long, stream_params(), "r")
    with pytest.raises(VLLMValidationError, match="logprobs"):
        client.generate(PROMPT, SamplingParams(max_tokens=4, logprobs=10_000), "r")
    assert channels["g0"].calls == 0


def test_no_routable_group_is_a_503_before_the_response_starts(frontend) -> None:
    client = client_over(frontend, {})
    with pytest.raises(GracefulHTTPError) as raised:
        client.generate(PROMPT, stream_params(), "r")
    assert raised.value.http_status == 503
    with pytest.raises(NoRoutableGroup):
        client.directory.router.route("r", [1], frozenset())


async def test_a_caller_leaving_early_counts_an_abort_and_releases_the_group(frontend) -> None:
    from flotilla.router.engine_client import REQUEST_CONTEXT, RequestContext

    channels = {"g0": ScriptedChannel([output([1], False), output([2], False), output([3], True)])}
    client = client_over(frontend, channels)
    REQUEST_CONTEXT.set(RequestContext("completions", 0.0))
    generator = client.generate(PROMPT, stream_params(), "r")
    await anext(generator)
    await generator.aclose()
    assert client.stats.aborted.labels("completions")._value.get() == 1
    assert client.directory.router.view("g0").in_flight == 0


class HeldChannel(ScriptedChannel):
    """A group that takes the request, then holds its first output until released."""

    def __init__(self) -> None:
        super().__init__([output([1], True)])
        self.submitted = asyncio.Event()
        self.release = asyncio.Event()
        self.closed = False

    async def stream(self, request: Any, key: str) -> AsyncGenerator[WireOutput, None]:
        self.calls += 1
        self.submitted.set()
        try:
            await self.release.wait()
            yield self.outputs[0]
        finally:
            self.closed = True


async def test_the_request_is_submitted_before_the_caller_first_iterates(frontend) -> None:
    """The engine starts while the serving layer sets up the response."""
    channel = HeldChannel()
    client = client_over(frontend, {"g0": channel})
    generator = client.generate(PROMPT, stream_params(), "r")
    await asyncio.wait_for(channel.submitted.wait(), timeout=10)  # nobody has iterated yet
    assert channel.calls == 1
    channel.release.set()
    assert [o.outputs[0].token_ids for o in await collect(generator)] == [[1]]
    assert client.directory.router.view("g0").in_flight == 0


async def test_a_stream_closed_before_its_first_output_stops_the_request(frontend) -> None:
    channel = HeldChannel()
    client = client_over(frontend, {"g0": channel})
    generator = client.generate(PROMPT, stream_params(), "r")
    await asyncio.wait_for(channel.submitted.wait(), timeout=10)
    await generator.aclose()
    assert channel.closed and not channel.release.is_set()
    assert client.directory.router.view("g0").in_flight == 0
    with pytest.raises(StopAsyncIteration):
        await anext(generator)
