"""The ``flotilla`` command: serve, status, make-model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cluster.config import ConfigError, ServeConfig

DEFAULT_CONFIG = "examples/local-cpu.yaml"


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} flotilla: {message}", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from cluster import launcher

    overrides = {key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None}
    try:
        config = ServeConfig.from_yaml(args.config, overrides)
        launcher.run_forever(config, _say, verbose=args.verbose)
    except ConfigError as err:
        print(f"flotilla: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cluster import status
    from cluster.ray_connect import connect

    try:
        connect(args.address, args.namespace)
    except ConnectionError as err:
        print(f"flotilla: no Ray cluster at {args.address!r}: {err}", file=sys.stderr)
        return 1
    groups = status.collect(args.namespace)
    print(status.render_json(groups) if args.json else status.render_table(groups))
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from cluster.tiny_models import TINY_MODELS, make_model

    names = args.names or sorted(TINY_MODELS)
    unknown = sorted(set(names) - TINY_MODELS.keys())
    if unknown:
        print(f"flotilla: unknown model(s) {unknown}; choose from {sorted(TINY_MODELS)}", file=sys.stderr)
        return 2
    for name in names:
        out_dir = Path(args.out) / name
        wrote = make_model(TINY_MODELS[name], out_dir)
        print(f"{name}: {'wrote' if wrote else 'up to date'} {out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start groups and the OpenAI endpoint; Ctrl-C stops everything")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG})")
    serve.add_argument("--host", help="override the config's host")
    serve.add_argument("--port", type=int, help="override the config's port")
    serve.add_argument("-v", "--verbose", action="store_true", help="show Ray and vLLM logs")
    serve.set_defaults(func=cmd_serve)

    status = commands.add_parser("status", help="show every group, rank, bundle, node and state")
    status.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    status.add_argument("--namespace", default="flotilla")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    make_model = commands.add_parser("make-model", help="build the tiny test models (Hugging Face folders)")
    make_model.add_argument("names", nargs="*", help="models to build (default: all)")
    make_model.add_argument("--out", default="models", help="parent folder (default: models)")
    make_model.set_defaults(func=cmd_make_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
