"""The ``flotilla`` command: serve, status, drain, resume, restart, plan, eplb-demo, make-model."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

from flotilla.cluster.config import ConfigError
from flotilla.cluster.contract import DEFAULT_NAMESPACE
from flotilla.config import ServeConfig

DEFAULT_CONFIG = "examples/local-cpu.yaml"


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} flotilla: {message}", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from flotilla import launcher

    overrides: dict[str, Any] = {
        key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None
    }
    if args.metrics_port is not None:
        overrides["ingress"] = {"metrics_port": args.metrics_port}
    try:
        config = ServeConfig.from_yaml(args.config, overrides)
        launcher.run_forever(config, _say, verbose=args.verbose)
    except ConfigError as err:
        print(f"flotilla: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from flotilla.cluster import status
    from flotilla.cluster.ray_connect import connect

    try:
        connect(args.address, args.namespace)
    except ConnectionError as err:
        print(f"flotilla: no Ray cluster at {args.address!r}: {err}", file=sys.stderr)
        return 1
    cluster = status.collect(args.namespace)
    print(status.render_json(cluster) if args.json else status.render_table(cluster))
    return 0


def cmd_group_action(args: argparse.Namespace) -> int:
    """drain / resume / restart one group through the coordinator."""
    import ray
    from ray.exceptions import RayTaskError

    from flotilla.cluster.contract import COORDINATOR_NAME
    from flotilla.cluster.ray_connect import connect

    try:
        connect(args.address, args.namespace)
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=args.namespace)
    except (ConnectionError, ValueError) as err:
        print(f"flotilla: no Flotilla coordinator at {args.address!r}: {err}", file=sys.stderr)
        return 1
    try:
        group = ray.get(getattr(coordinator, args.action).remote(args.group), timeout=60)
    except RayTaskError as err:
        cause = err.cause
        print(f"flotilla: {cause.args[0] if isinstance(cause, KeyError) else cause}", file=sys.stderr)
        return 1
    print(f"{group.name}: {group.state.value} ({group.detail})")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from flotilla.cluster.model_spec import ModelSpec, UnsupportedModelError
    from flotilla.cluster.plan_report import render_json, render_text
    from flotilla.cluster.planner import ClusterSpec, LinkKind, Workload, plan

    try:
        spec = ModelSpec.from_path(args.model)
    except (OSError, KeyError, UnsupportedModelError) as err:
        print(f"flotilla: cannot plan for {args.model}: {err}", file=sys.stderr)
        return 2
    cluster = ClusterSpec(
        nodes=args.nodes,
        accelerators_per_node=args.accelerators_per_node,
        memory_gib=args.memory_gib,
        intra_link=LinkKind(args.intra_link),
        inter_link=LinkKind(args.inter_link),
    )
    context = args.context_len or min(spec.max_position_embeddings or 8192, 8192)
    workload = Workload(context_len=context, concurrency=args.concurrency, latency_sensitive=args.latency_sensitive)
    result = plan(spec, cluster, workload, model_name=Path(args.model).name)
    print(render_json(result) if args.json else render_text(result))
    return 0 if result.ranked else 1


def cmd_make_model(args: argparse.Namespace) -> int:
    from flotilla.cluster.packaged_models import PACKAGED_MODELS, make_packaged_model
    from flotilla.cluster.tiny_models import DEFAULT_MODELS, TINY_MODELS, make_model

    names = args.names or [*DEFAULT_MODELS, *PACKAGED_MODELS]
    known = [*TINY_MODELS, *PACKAGED_MODELS]
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"flotilla: unknown model(s) {unknown}; choose from {sorted(known)}", file=sys.stderr)
        return 2
    for name in names:
        out_dir = Path(args.out) / name
        if name in PACKAGED_MODELS:
            wrote = make_packaged_model(PACKAGED_MODELS[name], out_dir, _say)
        else:
            wrote = make_model(TINY_MODELS[name], out_dir)
        print(f"{name}: {'wrote' if wrote else 'up to date'} {out_dir}")
    return 0


def cmd_eplb_demo(args: argparse.Namespace) -> int:
    from flotilla.cluster.eplb.demo import run_demo

    return run_demo(
        Path(args.model), args.ranks, args.redundant, args.duration_s, args.tokens_per_step, args.metrics_port, _say
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start groups and the OpenAI endpoint; Ctrl-C stops everything")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG})")
    serve.add_argument("--host", help="override the config's host")
    serve.add_argument("--port", type=int, help="override the config's port")
    serve.add_argument("--metrics-port", type=int, help="override the config's ingress.metrics_port")
    serve.add_argument("-v", "--verbose", action="store_true", help="show Ray and vLLM logs")
    serve.set_defaults(func=cmd_serve)

    status = commands.add_parser("status", help="show every group, rank, bundle, node and state")
    status.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    status.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    for action, description in (
        ("drain", "take a group out of routing; its in-flight requests finish"),
        ("resume", "put a drained group back into routing"),
        ("restart", "gang-restart a group: out of routing, in-flight requests finish, then recreated"),
    ):
        command = commands.add_parser(action, help=description)
        command.add_argument("group", help="group name, e.g. group-0 (see flotilla status)")
        command.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
        command.add_argument("--namespace", default=DEFAULT_NAMESPACE)
        command.set_defaults(func=cmd_group_action, action=action)

    plan = commands.add_parser("plan", help="rank TP/PP/DP/EP layouts for a model on a cluster, and say why")
    plan.add_argument("--model", required=True, help="model folder or config.json")
    plan.add_argument("--nodes", type=int, required=True)
    plan.add_argument("--accelerators-per-node", type=int, required=True)
    plan.add_argument("--memory-gib", type=float, required=True, help="memory per accelerator")
    plan.add_argument("--intra-link", choices=["nvlink", "pcie"], default="nvlink")
    plan.add_argument("--inter-link", choices=["rdma", "ethernet"], default="rdma")
    plan.add_argument("--context-len", type=int, help="tokens per sequence (default: the model's, at most 8192)")
    plan.add_argument("--concurrency", type=int, default=64, help="sequences in flight over the cluster")
    plan.add_argument("--latency-sensitive", action="store_true", help="rank by per-token latency")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    eplb_demo = commands.add_parser(
        "eplb-demo", help="CPU expert parallelism on the tiny MoE model, rebalanced live by the EPLB controller"
    )
    eplb_demo.add_argument("--model", default="models/tiny-mixtral", help="Mixtral-style model folder")
    eplb_demo.add_argument("--ranks", type=int, default=4, help="EP ranks, one Ray actor each (default: 4)")
    eplb_demo.add_argument("--redundant", type=int, help="redundant expert slots (default: one per rank)")
    eplb_demo.add_argument("--duration-s", type=float, default=60.0, help="serve for this long (default: 60)")
    eplb_demo.add_argument("--tokens-per-step", type=int, default=256)
    eplb_demo.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    eplb_demo.set_defaults(func=cmd_eplb_demo)

    make_model = commands.add_parser(
        "make-model", help="build the models Flotilla serves without a model hub (Hugging Face folders)"
    )
    make_model.add_argument(
        "names",
        nargs="*",
        help="models to build: tiny-llama, tiny-mixtral, smollm2-135m-instruct (default: these), bench-llama and "
        "llama3-8b-shape (config and tokenizer only: serve with load_format dummy)",
    )
    make_model.add_argument("--out", default="models", help="parent folder (default: models)")
    make_model.set_defaults(func=cmd_make_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = int(args.func(args))
    # The interpreter's exit collects every object still tracked: all that vLLM, torch and Ray made here,
    # 2 of a `flotilla serve` Ctrl-C's 11 s on 2 cores. Nothing of it needs collecting any more.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
