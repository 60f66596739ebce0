"""Wide-EP on vLLM's CPU build with Flotilla's platform plugin: tiny-mixtral served by two vLLM engines
(DP = 2 × EP = 2, one OpenAI server per DP rank, as an external load balancer drives them) answers
greedy requests on both ranks at once exactly as one engine without EP does.

Without the plugin's two CPU pieces (``flotilla.cluster.vllm_cpu_ep``) the naive all-to-all raises
``NotImplementedError`` in ``all_gatherv`` and the experts read past their local weights.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from devtools import wait_for
from flotilla.cluster.ports import free_port
from tests.e2e.server import STARTUP_TIMEOUT_S, vllm_serve

pytestmark = pytest.mark.e2e

MODEL = "tiny-mixtral"
PROMPTS = [f"The {word} river and the mountain {i}" for i, word in enumerate(["red", "old", "long", "quiet"] * 2)]


def greedy(url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def answers(urls: list[str]) -> list[str]:
    """Every prompt, spread over ``urls`` and sent concurrently (both DP ranks busy at once)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda i: greedy(urls[i % len(urls)], PROMPTS[i]), range(len(PROMPTS))))


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_dp2_ep2_engines_answer_like_one_engine(tiny_mixtral: Path) -> None:
    with vllm_serve(tiny_mixtral, MODEL, []) as url:
        reference = answers([url])
    rpc_port = free_port()
    dp_flags = ["--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1"]
    dp_flags += ["--data-parallel-rpc-port", str(rpc_port), "--enable-expert-parallel"]
    with ExitStack() as stack:
        urls = [
            stack.enter_context(vllm_serve(tiny_mixtral, MODEL, [*dp_flags, "--data-parallel-rank", str(rank)], False))
            for rank in range(2)
        ]
        assert wait_for(lambda: all(healthy(u) for u in urls), STARTUP_TIMEOUT_S), "the DP ranks never came up"
        assert answers(urls) == reference
