"""Where a Flotilla group's CPU time goes: per process role, idle and under vLLM's `bench serve` load.

Starts a ``bench.serve_overhead`` target (default ``flotilla``: ``flotilla serve``, 1 group of
tiny-llama, defaults), then samples every process's CPU time (psutil) over an idle window and over a
``bench serve`` run at ``--concurrency``, and reports the cores each role used, and under load
its CPU time per request (which, unlike cores, does not move with how fast the run went): the
group's worker and EngineCore, its leader, the ingress, HAProxy, the coordinator, Ray's own daemons
(or, for a vLLM target, its API servers). What runs while nothing is asked of the server is what
steals time from a decode step on a small machine.

    python -m bench.cpu_breakdown [--idle-s 20] [--prompts 16] [--target flotilla-2g --concurrency 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import psutil

from bench.common import RESULTS, write_docs_section
from bench.serve_overhead import TARGETS, EngineSettings, bench_serve
from devtools import REPO

ROLES = (  # (role, substring of the process's command line), first match wins
    ("group worker", "RayWorkerProc"),  # executor: ray
    ("group worker", "VLLM::Worker"),  # executor: mp with more ranks than one, or cpu.rank_in_engine_core false
    ("EngineCore", "EngineCore"),  # with one rank (cpu.rank_in_engine_core), the model runs in it too
    ("group leader", "GroupLeader"),
    ("ingress", "OpenAIIngress"),
    ("coordinator", "Coordinator"),
    ("serve controller", "ServeController"),
    ("HAProxy", "haproxy"),
    ("flotilla serve", "flotilla.cli serve"),
    ("vLLM API server", "vllm.entrypoints.openai.api_server"),
    ("raylet", "raylet"),
    ("gcs", "gcs_server"),
    ("dashboard and agents", "dashboard"),
    ("other Ray workers", "ray::"),
)


SPAWNED_BY = {"group leader": "EngineCore", "vLLM API server": "EngineCore", "EngineCore": "group worker"}
"""The role of a process that kept its spawn command line (vLLM could not title it), by its parent's role."""


def role_of(process: psutil.Process) -> str | None:
    try:
        command = " ".join(process.cmdline())
        parent = process.parent() if "multiprocessing.spawn" in command else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    role = next((role for role, needle in ROLES if needle in command), None)
    if role is None and parent is not None:
        return SPAWNED_BY.get(role_of(parent) or "")
    return role


def cpu_seconds() -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for process in psutil.process_iter():
        role = role_of(process)
        if role is None:
            continue
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        totals[role] += times.user + times.system
    return totals


def window(run) -> tuple[float, dict[str, float]]:
    before, began = cpu_seconds(), time.monotonic()
    run()
    after, wall = cpu_seconds(), time.monotonic() - began
    return wall, {role: max(0.0, after[role] - before.get(role, 0.0)) for role in after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--idle-s", type=float, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--target", choices=sorted(TARGETS), default="flotilla", help="a bench.serve_overhead target")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    args.model = args.model.resolve()
    load_args = argparse.Namespace(input_len=512, output_len=64, seed=0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    settings = EngineSettings(device="cpu", dummy_weights=False)
    target = TARGETS[args.target](args.model, Path(tempfile.mkdtemp()), settings)
    target.start()
    try:
        bench_serve(target.url, args.model, load_args, 4, 1)  # warm-up
        idle_wall, idle = window(lambda: time.sleep(args.idle_s))
        busy_wall, busy = window(lambda: bench_serve(target.url, args.model, load_args, args.prompts, args.concurrency))
    finally:
        target.stop()
    lines = [
        f"Date: {date.today().isoformat()}. Command: `python -m bench.cpu_breakdown {' '.join(sys.argv[1:])}`. "
        f"Target `{args.target}` (bench.serve_overhead) of `{args.model.name}`; idle window {args.idle_s:.0f} s, "
        f"then {args.prompts} requests (512 in / 64 out tokens) at concurrency {args.concurrency} from vLLM's "
        "`bench serve`.",
        "",
        f"| process role | cores used, idle | cores used, concurrency-{args.concurrency} load | CPU per request |",
        "|---|---|---|---|",
    ]

    def row(role: str, idle_s: float, busy_s: float) -> str:
        per_request_ms = 1000 * busy_s / args.prompts
        return f"| {role} | {idle_s / idle_wall:.3f} | {busy_s / busy_wall:.3f} | {per_request_ms:.1f} ms |"

    for role in dict.fromkeys(role for role, _ in ROLES):
        if role in idle or role in busy:
            lines.append(row(role, idle.get(role, 0), busy.get(role, 0)))
    lines.append(row("**all**", sum(idle.values()), sum(busy.values())))
    report = "\n".join(lines)
    (RESULTS / "cpu_breakdown.md").write_text(report + "\n")
    if not args.no_docs:
        write_docs_section("cpu_breakdown", report, "Where a group's CPU time goes")
    print(report)


if __name__ == "__main__":
    main()
