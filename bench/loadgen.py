"""A small async load generator for OpenAI-compatible streaming completions.

TTFT is the time from sending the request to the first SSE data event that carries a
choice (a token); output tokens come from the final usage chunk
(``stream_options.include_usage``), so both servers are counted the same way.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class RequestResult:
    ttft_s: float
    latency_s: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class RunSummary:
    requests: int
    concurrency: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    latency_p50_s: float

    @classmethod
    def of(cls, results: list[RequestResult], concurrency: int, wall_s: float) -> RunSummary:
        ttfts = sorted(r.ttft_s for r in results)
        return cls(
            requests=len(results),
            concurrency=concurrency,
            wall_s=wall_s,
            output_tokens_per_s=sum(r.completion_tokens for r in results) / wall_s,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p99_s=percentile(ttfts, 99),
            ttft_mean_s=statistics.fmean(ttfts),
            latency_p50_s=percentile(sorted(r.latency_s for r in results), 50),
        )


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile."""
    if not sorted_values:
        return float("nan")
    rank = max(1, round(pct / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("choices") and ttft is None:
                ttft = time.perf_counter() - started
            if event.get("usage"):
                usage = event["usage"]
    if ttft is None or not usage:
        raise RuntimeError("stream ended without tokens or usage")
    return RequestResult(
        ttft_s=ttft,
        latency_s=time.perf_counter() - started,
        completion_tokens=usage["completion_tokens"],
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
    )


async def run_load(url: str, bodies: list[dict], concurrency: int) -> RunSummary:
    """Send every body, at most ``concurrency`` at a time; every request must succeed."""
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await stream_completion(client, url, queue.get_nowait()))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return RunSummary.of(results, concurrency, wall)
