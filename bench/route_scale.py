"""Routing decision latency at scale, on the simulated engine.

``groups`` simulated groups of ``blocks_per_group`` KV blocks each; their caches (the prefix
index, fed by their KV events) are first filled with block chains of random prompts until the
index holds ``groups × blocks_per_group`` blocks, then a shared-prefix workload runs through
the router and every ``Router.route`` call is timed (block keys + prefix match + policy).

    python -m bench.route_scale --groups 1000 --blocks-per-group 1000
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from datetime import date

from bench.common import RESULTS, percentile, write_docs_section
from bench.workloads import shared_prefix
from flotilla.router.block_keys import block_keys
from flotilla.router.policies import make_policy
from flotilla.router.routing import Router
from flotilla.router.sim_cluster import SimCluster
from flotilla.router.sim_engine import SimEngineConfig

SECTION = "route_scale"


def fill_index(router: Router, groups: list[str], blocks_per_group: int, block_size: int, seed: int) -> float:
    """Give every group ``blocks_per_group`` cached blocks, as its KV events would report them."""
    rng = random.Random(seed)
    started = time.perf_counter()
    prompt_blocks = 16
    for group in groups:
        for _ in range(blocks_per_group // prompt_blocks):
            prompt = [rng.randrange(100, 1000) for _ in range(prompt_blocks * block_size)]
            router.index.record_stored(group, block_keys(prompt, block_size))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--blocks-per-group", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--prompt-groups", type=int, default=200)
    parser.add_argument("--prompts-per-group", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()

    config = SimEngineConfig(block_size=args.block_size, num_blocks=args.blocks_per_group)
    router = Router(make_policy(args.policy), args.block_size)
    cluster = SimCluster(router, args.groups, config, precise=True)
    fill_s = fill_index(router, list(cluster.engines), args.blocks_per_group, args.block_size, seed=1)
    indexed = router.index.size()
    gc.collect()
    gc.freeze()  # as the ingress does once its index is built: long-lived state out of the collector's scans
    sessions = shared_prefix(list(range(100, 1000)), args.prompt_groups, args.prompts_per_group, 1024, 128, 16, seed=2)
    result = cluster.run(sessions, args.concurrency)
    decisions = sorted(result.decision_s)
    summary = {
        "groups": args.groups,
        "indexed_blocks": indexed,
        "block_size": args.block_size,
        "decisions": len(decisions),
        "decision_p50_us": 1e6 * percentile(decisions, 50),
        "decision_p99_us": 1e6 * percentile(decisions, 99),
        "decision_max_us": 1e6 * decisions[-1],
        "decision_mean_us": 1e6 * statistics.fmean(decisions),
        "fill_s": fill_s,
        "hit_rate": result.hit_rate,
    }
    command = "python -m bench.route_scale " + " ".join(sys.argv[1:])
    report = (
        f"Date: {date.today().isoformat()}. Command: `{command.strip()}`. Simulated engines "
        f"(`router/sim_engine.py`), precise index (KV events), policy `{args.policy}`.\n\n"
        "| groups | indexed blocks | block size | decisions | p50 | p99 | max |\n|---|---|---|---|---|---|---|\n"
        f"| {args.groups} | {indexed:,} | {args.block_size} | {len(decisions):,} | "
        f"{summary['decision_p50_us']:.0f} µs | {summary['decision_p99_us']:.0f} µs | "
        f"{summary['decision_max_us']:.0f} µs |\n\n"
        "A decision covers hashing the prompt into block keys, matching them against the index and the "
        "policy's pass over every group."
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{SECTION}.json").write_text(json.dumps(summary, indent=2))
    if not args.no_docs:
        write_docs_section(SECTION, report, "Routing decision latency at scale (simulated engine)")
    print(report)


if __name__ == "__main__":
    main()
