"""Fuzz: schemathesis against the OpenAPI document ``flotilla serve`` serves, every ``/v1`` and ``/admin`` route.

Starts ``flotilla serve`` (2 groups of ``tiny-llama``, an admin token) and runs schemathesis's CLI (``st run``,
a fuzzer nobody here wrote) over ``/openapi.json`` with the admin token on every request, then checks the
server still answers a completion. Every response is read from schemathesis's NDJSON report: a response
≥ 500 or a request with no response within ``--request-timeout-s`` (a hang) is a failure.

    python -m bench.fuzz [--max-examples 50] [--phases examples,coverage,fuzzing]

Results: bench/results/fuzz.{json,md} and docs/benchmarks.md. ``tests/e2e/test_fuzz.py`` runs a bounded one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import httpx

from bench.common import RESULTS, publish, start_flotilla, wait_ready
from devtools import REPO

SECTION = "fuzz"
MODEL = "tiny-llama"
ADMIN_TOKEN = "fuzz-admin-token"


@dataclass
class FuzzResult:
    operations: set[str] = field(default_factory=set)
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    """``METHOD path -> status`` of every response ≥ 500."""
    no_response: list[str] = field(default_factory=list)
    """Requests that got no response (timed out or the connection failed)."""
    exit_code: int = 0
    elapsed_s: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + len(self.no_response)


def run_schemathesis(
    url: str,
    admin_token: str,
    max_examples: int,
    phases: str,
    request_timeout_s: float,
    seed: int,
    report_dir: Path,
    max_time_s: float | None = None,
) -> FuzzResult:
    """``st run`` over ``url``'s OpenAPI document; what every response was, from its NDJSON report."""
    report_dir.mkdir(parents=True, exist_ok=True)
    ndjson = report_dir / "schemathesis.ndjson"
    command = [
        str(Path(sys.executable).with_name("st")),
        "run",
        f"{url}/openapi.json",
        "--header",
        f"Authorization: Bearer {admin_token}",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(max_examples),
        "--phases",
        phases,
        "--request-timeout",
        str(request_timeout_s),
        "--seed",
        str(seed),
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(ndjson),
        "--no-color",
        *(["--max-time", str(int(max_time_s))] if max_time_s else []),
    ]
    began = time.monotonic()
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    (report_dir / "schemathesis.log").write_text(completed.stdout + completed.stderr)
    result = FuzzResult(exit_code=completed.returncode, elapsed_s=time.monotonic() - began)
    if not ndjson.exists():
        raise RuntimeError(f"schemathesis wrote no report (exit {completed.returncode}):\n{completed.stdout[-3000:]}")
    for line in ndjson.read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if finished is None:
            continue
        recorder = finished["recorder"]
        result.operations.add(recorder["label"])
        for case_id, interaction in recorder.get("interactions", {}).items():
            request, response = interaction["request"], interaction.get("response")
            where = f"{request['method']} {request['uri'].removeprefix(url)}"
            if response is None:
                result.no_response.append(f"{where} (case {case_id})")
                continue
            status = int(response["status_code"])
            result.statuses[status] += 1
            if status >= 500:
                result.server_errors.append(f"{where} -> {status} (case {case_id})")
    return result


def still_serves(url: str) -> bool:
    body = {"model": MODEL, "prompt": "after the fuzz run", "max_tokens": 4}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def markdown(result: FuzzResult, serves_after: bool, command: str, schemathesis_version: str) -> str:
    by_class = Counter(f"{status // 100}xx" for status in result.statuses.elements())
    classes = ", ".join(f"{name} {count}" for name, count in sorted(by_class.items()))
    lines = [
        f"Date: {date.today().isoformat()}. Command: `{command}`. Fuzzer: schemathesis {schemathesis_version} "
        f"(`st run`, check `not_a_server_error`) over the served `/openapi.json`, the admin token on every request. "
        f"Server: `flotilla serve`, 2 groups of `{MODEL}` (CPU).",
        "",
        "| operations | requests | responses | ≥ 500 | no response (hang or connection error) | serves after | time |",
        "|---|---|---|---|---|---|---|",
        f"| {len(result.operations)} | {result.requests} | {classes} | {len(result.server_errors)} | "
        f"{len(result.no_response)} | {'yes' if serves_after else '**no**'} | {result.elapsed_s:.0f} s |",
    ]
    for failure in result.server_errors[:10] + result.no_response[:10]:
        lines.append(f"- {failure}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=50, help="per operation and phase")
    parser.add_argument("--phases", default="examples,coverage,fuzzing")
    parser.add_argument("--request-timeout-s", type=float, default=120)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-time-s", type=float, default=1800, help="time budget of the whole run")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    from importlib.metadata import version

    url, server = start_flotilla(SECTION, MODEL, groups=2, env={"FLOTILLA_ADMIN_TOKEN": ADMIN_TOKEN})
    report_dir = RESULTS / "fuzz-reports"
    shutil.rmtree(report_dir, ignore_errors=True)
    try:
        wait_ready(url, server)
        result = run_schemathesis(
            url,
            ADMIN_TOKEN,
            args.max_examples,
            args.phases,
            args.request_timeout_s,
            args.seed,
            report_dir,
            args.max_time_s,
        )
        serves_after = still_serves(url)
    finally:
        server.stop()
    report = markdown(
        result, serves_after, ("python -m bench.fuzz " + " ".join(sys.argv[1:])).strip(), version("schemathesis")
    )
    data = {"args": vars(args), "operations": sorted(result.operations), "statuses": result.statuses}
    data |= {"server_errors": result.server_errors, "no_response": result.no_response, "serves_after": serves_after}
    publish(SECTION, "Fuzz: schemathesis over the served OpenAPI document", report, data, docs=not args.no_docs)


if __name__ == "__main__":
    main()
