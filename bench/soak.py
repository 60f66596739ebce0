"""Soak: many concurrent clients for minutes through ``flotilla serve``, with nothing lost and nothing growing.

Starts ``flotilla serve`` with 2 groups of ``tiny-llama`` and keeps ``--streams`` clients busy for
``--duration-s``, each sending one request after another, cycling through the four shapes users send:
chat and completions, streamed (with ``stream_options.include_usage``) and not. Every answer is checked:
HTTP 200; a stream ends with a usage chunk then ``data: [DONE]``; a body has ``usage``. Meanwhile the
ingress replicas' and group leaders' memory (RSS) and open files are sampled; growth is measured from
the end of warm-up (the first ``--warmup-s``) to the end of the run.

    python -m bench.soak [--streams 256] [--duration-s 300]

Results: bench/results/soak.{json,md} and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import date
from typing import Any

import httpx
import psutil

from bench.common import publish, start_flotilla, wait_ready

SECTION = "soak"
MODEL = "tiny-llama"
ROLES = {"ingress": "OpenAIIngress", "leader": "GroupLeader"}  # substring of the Ray actor's process title
SHAPES = ("chat", "chat-stream", "completion", "completion-stream")


@dataclass
class Sample:
    at_s: float
    rss_mib: dict[str, float]
    open_files: dict[str, int]


@dataclass
class SoakResult:
    streams: int
    duration_s: float
    requests: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    unfinished: int = 0

    def growth(self, warmup_s: float) -> dict[str, dict[str, float]]:
        """Per role: RSS growth (fraction) and open-file growth (count) from the first sample after warm-up."""
        after = [s for s in self.samples if s.at_s >= warmup_s] or self.samples
        first, last = after[0], after[-1]
        return {
            role: {
                "rss_mib_start": first.rss_mib[role],
                "rss_mib_end": last.rss_mib[role],
                "rss_growth": last.rss_mib[role] / first.rss_mib[role] - 1,
                "open_files_growth": last.open_files[role] - first.open_files[role],
            }
            for role in first.rss_mib
            if role in last.rss_mib
        }


def role_processes() -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {role: [] for role in ROLES}
    for process in psutil.process_iter():
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue
        for role, needle in ROLES.items():
            if needle in command and command.startswith("ray::"):
                found[role].append(process)
    return found


def sample(at_s: float) -> Sample:
    rss: dict[str, float] = {}
    files: dict[str, int] = {}
    for role, processes in role_processes().items():
        try:
            rss[role] = sum(p.memory_info().rss for p in processes) / 2**20
            files[role] = sum(p.num_fds() for p in processes)
        except psutil.Error:
            continue
    return Sample(at_s, rss, files)


def request_for(shape: str, index: int) -> tuple[str, dict[str, Any]]:
    stream = shape.endswith("-stream")
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 8 + index % 9, "ignore_eos": True, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    text = f"soak request {index}: the harbour at dawn, " * (1 + index % 4)
    if shape.startswith("chat"):
        return "/v1/chat/completions", common | {"messages": [{"role": "user", "content": text}]}
    return "/v1/completions", common | {"prompt": text}


def check(shape: str, status: int, body: str) -> str | None:
    """None when the answer is complete; else what is wrong with it."""
    if status != 200:
        return f"{shape}: HTTP {status}: {body[:200]}"
    if shape.endswith("-stream"):
        events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"{shape}: stream did not end with [DONE]: {body[-200:]}"
        if len(events) < 2 or not json.loads(events[-2]).get("usage"):
            return f"{shape}: no usage chunk before [DONE]"
        if any('"error"' in e for e in events):
            return f"{shape}: error event in the stream"
        return None
    return None if json.loads(body).get("usage") else f"{shape}: no usage in the body"


async def soak(
    url: str, streams: int, duration_s: float, sample_every_s: float = 10.0, request_timeout_s: float = 600
) -> SoakResult:
    """``streams`` clients, one request after another each, until ``duration_s``; then wait for the last answers."""
    result = SoakResult(streams, duration_s)
    began = time.monotonic()
    deadline = began + duration_s
    counter = itertools.count()
    in_flight = 0

    async def client(http: httpx.AsyncClient, worker: int) -> None:
        nonlocal in_flight
        while time.monotonic() < deadline:
            index = next(counter)
            shape = SHAPES[(index + worker) % len(SHAPES)]
            path, body = request_for(shape, index)
            in_flight += 1
            try:
                response = await http.post(f"{url}{path}", json=body)
                problem = check(shape, response.status_code, response.text)
            except (httpx.HTTPError, ValueError) as err:
                problem = f"{shape}: {type(err).__name__}: {err}"
            in_flight -= 1
            result.requests[shape] += 1
            if problem:
                result.failures.append(problem)

    async def sampler() -> None:
        while time.monotonic() < deadline:
            result.samples.append(await asyncio.to_thread(sample, time.monotonic() - began))
            await asyncio.sleep(sample_every_s)

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as http:
        sampling = asyncio.create_task(sampler())
        clients = [asyncio.create_task(client(http, i)) for i in range(streams)]
        await asyncio.wait(clients, timeout=duration_s + request_timeout_s)
        result.unfinished = in_flight
        for task in clients:
            task.cancel()
        await sampling
    result.samples.append(await asyncio.to_thread(sample, time.monotonic() - began))
    return result


def markdown(result: SoakResult, warmup_s: float, command: str) -> str:
    total = sum(result.requests.values())
    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command}`. `flotilla serve`, 2 groups of `{MODEL}` (TP=1, "
        f"CPU), {result.streams} concurrent clients for {result.duration_s:.0f} s, each cycling chat and "
        f"completions, streamed and not (8–16 tokens, ignore_eos).",
        "",
        f"- Requests: {total} ({', '.join(f'{k} {v}' for k, v in sorted(result.requests.items()))}); "
        f"failed or incomplete: **{len(result.failures)}**; never answered: **{result.unfinished}**.",
    ]
    for role, g in result.growth(warmup_s).items():
        lines.append(
            f"- {role} (all replicas): RSS {g['rss_mib_start']:.0f} → {g['rss_mib_end']:.0f} MiB after "
            f"{warmup_s:.0f} s of warm-up (**{g['rss_growth']:+.1%}**), open files {g['open_files_growth']:+d}."
        )
    if result.failures:
        lines.append(f"- First failures: {result.failures[:3]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--duration-s", type=float, default=300)
    parser.add_argument("--warmup-s", type=float, default=60)
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    url, server = start_flotilla(SECTION, MODEL, groups=2)
    try:
        wait_ready(url, server)
        result = asyncio.run(soak(url, args.streams, args.duration_s))
    finally:
        server.stop()
    report = markdown(result, args.warmup_s, ("python -m bench.soak " + " ".join(sys.argv[1:])).strip())
    data = {"args": vars(args), "requests": result.requests, "failures": result.failures}
    data |= {"unfinished": result.unfinished, "samples": [asdict(s) for s in result.samples]}
    publish(SECTION, "Soak: concurrent clients for minutes, nothing lost or growing", report, data, not args.no_docs)


if __name__ == "__main__":
    main()
