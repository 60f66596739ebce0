"""The OpenAI endpoint served the way `make serve` serves it: real vLLM groups on Ray."""

from __future__ import annotations

import json
import re
import signal
import socket

import httpx
import openai
import pytest
import ray

from devtools import wait_for
from flotilla.cluster.contract import DEFAULT_NAMESPACE, leader_actor_name
from flotilla.cluster.ray_connect import connect
from tests.e2e.faults import cluster_status
from tests.e2e.server import Server, flotilla_serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MODEL = "smollm2-135m-instruct"  # what examples/local-cpu.yaml serves
GROUPS = ("group-0", "group-1")


@pytest.fixture(scope="module")
def server(smollm2) -> Server:
    with flotilla_serve(ingress_replicas=None) as running:  # make serve's config, every default
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ray_driver(server: Server):
    connect(server.ray_address)
    yield
    ray.shutdown()


def metric(text: str, name: str, **labels: str) -> float:
    """The samples called ``name`` with ``labels``, summed (over ingress replicas, for instance)."""
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", re.M)
    return sum(
        float(value)
        for found_labels, value in pattern.findall(text)
        if all(part in found_labels.split(",") for part in selector.split(","))
    )


def test_startup_shows_progress_per_group(server: Server) -> None:
    out = server.output()
    for group in GROUPS:
        assert f"[{group}] placement" in out
        assert re.search(rf"\[{group}\] placed \(PP0→node \w+\)", out)
        assert re.search(rf"\[{group}\] ready in [\d.]+ s", out)
    assert f"serving {MODEL} at {server.url}/v1" in out


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_and_its_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="The river and the mountain", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_and_its_stream_agree(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_a_real_model_answers_in_words(client: openai.OpenAI) -> None:
    """The README's first request, greedy: a real answer, not the tiny models' gibberish."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_structured_output_holds_a_real_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        temperature=0,
        max_tokens=40,
    )
    assert json.loads(reply.choices[0].message.content) == {"city": "Paris"}


def test_sse_stream_ends_with_done(server: Server) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert len(events) == 4  # one event per token, then [DONE]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "bad", [{"stop": ""}, {"min_tokens": 10, "max_tokens": 2}, {"logprobs": 10_000, "top_logprobs": 10_000}]
)
def test_invalid_sampling_is_a_400_at_once(server: Server, path: str, stream: bool, bad: dict) -> None:
    """Rejected by vLLM's own checks in the ingress, before any engine work; never a held request."""
    body = {"model": MODEL, "stream": stream} | bad
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = httpx.post(f"{server.url}{path}", json=body, timeout=5)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_an_exception_in_every_leader_ends_the_request_and_the_next_one_is_served(server: Server, ray_driver) -> None:
    """Whatever breaks inside a group ends the request with an error within 5 s (after failover)."""
    leaders = [ray.get_actor(leader_actor_name(g), namespace=DEFAULT_NAMESPACE) for g in GROUPS]

    def break_engine(leader) -> None:
        async def failing_generate(*args, **kwargs):
            raise RuntimeError("injected failure")
            yield  # an async generator, like AsyncLLM.generate

        leader.healthy_generate = leader.engine.generate
        leader.engine.generate = failing_generate

    def mend_engine(leader) -> None:
        leader.engine.generate = leader.healthy_generate

    ray.get([leader.__ray_call__.remote(break_engine) for leader in leaders])
    try:
        plain = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        response = httpx.post(f"{server.url}/v1/completions", json=plain, timeout=5)
        assert response.status_code == 503 and "injected failure" in response.text
        assert response.headers["retry-after"]
        streamed = httpx.post(f"{server.url}/v1/completions", json=plain | {"stream": True}, timeout=5)
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "injected failure" in events[0] and events[-1] == "data: [DONE]"
    finally:
        ray.get([leader.__ray_call__.remote(mend_engine) for leader in leaders])
    assert httpx.post(f"{server.url}/v1/completions", json=plain, timeout=30).status_code == 200


def test_the_leaders_and_ingress_replicas_froze_their_start_up_heap(server: Server, ray_driver) -> None:
    """As vLLM's API server does once up (``freeze_gc_heap``): otherwise a full garbage collection over the
    start-up heap pauses an ingress replica or a leader, and every stream through it, for most of a second."""
    import gc

    from ray.util.state import list_actors

    leaders = [ray.get_actor(leader_actor_name(g), namespace=DEFAULT_NAMESPACE) for g in GROUPS]
    alive = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")], limit=10_000)
    names = [a.name for a in alive]
    replicas = [ray.get_actor(n, namespace="serve") for n in names if n.startswith("SERVE_REPLICA::flotilla")]
    assert replicas, names
    frozen = ray.get([actor.__ray_call__.remote(lambda _: gc.get_freeze_count()) for actor in leaders + replicas])
    assert all(count > 100_000 for count in frozen), frozen


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)


def test_server_still_serves_after_bad_input(client: openai.OpenAI) -> None:
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=2).usage.completion_tokens == 2


def test_both_groups_receive_traffic(server: Server, client: openai.OpenAI) -> None:
    before = server.metrics()
    for i in range(4):
        client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=4, extra_body={"ignore_eos": True})
    after = server.metrics()
    served = {
        group: metric(after, "flotilla_generation_tokens_total", group=group)
        - metric(before, "flotilla_generation_tokens_total", group=group)
        for group in GROUPS
    }
    assert sum(served.values()) == 16
    assert all(tokens > 0 for tokens in served.values()), served  # distinct prompts on idle groups spread
    for group in GROUPS:
        assert metric(after, "flotilla_routing_decisions_total", policy="cache_aware", group=group) >= 1


def test_a_repeated_prefix_is_served_from_the_engine_cache_it_was_routed_to(client: openai.OpenAI) -> None:
    """cache_aware with KV events: a prompt sharing a long prefix lands where that prefix is cached."""
    for topic in ("river", "mountain", "garden"):
        prefix = f" {topic}" * 600  # ≈ 600 tokens: 4 full 128-token blocks
        first = client.completions.create(model=MODEL, prompt=prefix + " one", max_tokens=2)
        assert (first.usage.prompt_tokens_details.cached_tokens or 0) == 0
        second = client.completions.create(model=MODEL, prompt=prefix + " two", max_tokens=2)
        assert second.usage.prompt_tokens_details.cached_tokens >= 512, topic


def test_health_and_metrics(server: Server) -> None:
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["groups"] == list(GROUPS)
    text = server.metrics()
    assert metric(text, "flotilla_requests_total", endpoint="completions", status="200") > 0
    assert metric(text, "flotilla_requests_total", endpoint="completions", status="404") > 0
    assert "flotilla_time_to_first_token_seconds_bucket" in text
    assert metric(text, "flotilla_routing_decision_seconds_count", policy="cache_aware") > 0
    assert "flotilla_routing_matched_block_ratio_bucket" in text
    for group in GROUPS:
        assert re.search(rf'^flotilla_group_load\{{group="{group}",replica="[^"]+",signal="kv_usage"\}}', text, re.M)
    for group in GROUPS:  # each engine's own counters, re-exported with a group label
        assert metric(text, "vllm:generation_tokens_total", group=group) > 0
        assert re.search(rf'^vllm:kv_cache_usage_perc\{{[^}}]*group="{group}"', text, re.M)


def test_client_disconnect_aborts_the_engine_request(server: Server, ray_driver) -> None:
    leaders = [ray.get_actor(leader_actor_name(g), namespace=DEFAULT_NAMESPACE) for g in GROUPS]

    def unfinished() -> int:
        return sum(ray.get([leader.num_unfinished_requests.remote() for leader in leaders]))

    assert unfinished() == 0
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        # Held in a name: a bare `for line in response.iter_lines(): break` drops the iterator, and httpcore
        # closes the connection as it is collected, which disconnects before the count below is read.
        lines = response.iter_lines()
        line = next(line for line in lines if line.startswith("data: "))
        assert unfinished() == 1, line
        lines.close()  # the client goes away here
    # 2000 tokens take well over 10 s here; the abort must free the engine long before that.
    assert wait_for(lambda: unfinished() == 0, timeout_s=5), "engine request still running after disconnect"
    text = server.metrics()
    assert metric(text, "flotilla_aborted_requests_total", endpoint="completions") == 1


def test_status_shows_every_group_rank_bundle_and_node(server: Server) -> None:
    listed = cluster_status(server)
    assert listed["eplb"] == []  # no expert-parallel group in this deployment
    groups = listed["groups"]
    assert [g["name"] for g in groups] == list(GROUPS)
    for group in groups:
        assert group["state"] == "ready"
        assert group["leader"]["state"] == "ALIVE"
        (rank,) = group["ranks"]  # executor auto → mp: the rank runs in the leader's bundle, as its child process
        assert rank["bundle"] == 0 and rank["worker"]["state"] == "ALIVE" and rank["worker"]["pid"]
        # cpu.rank_in_engine_core: the one rank is vLLM's EngineCore process itself, no worker process beside it
        assert rank["worker"]["name"] == "VLLM::EngineCore"
        assert rank["node_id"] == rank["worker"]["node_id"] == group["leader"]["node_id"]


def test_ctrl_c_shuts_everything_down(server: Server, ray_driver) -> None:
    """Runs last in this module: SIGINT, as Ctrl-C sends, stops the groups, Serve and Ray."""
    ray.shutdown()  # this test process must not keep the cluster alive
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=120) == 0
    assert "flotilla: shutting down" in server.output() and "flotilla: stopped" in server.output()
    host, port = server.ray_address.rsplit(":", 1)
    assert wait_for(lambda: not port_open(host, int(port)), timeout_s=30), "Ray GCS still listening"
    http_port = int(server.url.rsplit(":", 1)[1])
    assert not port_open("127.0.0.1", http_port)


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0
