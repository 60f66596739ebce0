"""vLLM's own OpenAI frontend, run in the ingress over the routed engine client.

Render once, in the ingress: a GPU-less ``VllmConfig`` built from the groups' own engine
arguments (tokenizer, chat template, generation-config defaults, structured outputs, the
groups' ``max_model_len``) gives vLLM's renderer and input processor exactly the view the
engines have, as vLLM's CPU-only render server does (``vllm.entrypoints.launchers.render``).
vLLM's app (``build_app`` + ``init_app_state``) then serves every ``/v1`` route with its own
protocol models and serving classes (chat, completions, responses, tokenize, models, …);
they reach the cluster only through :class:`router.engine_client.RoutedEngineClient`.

The alternative, vLLM's serving classes inside each group leader (as Ray Serve LLM runs them
in each replica), would render every request in the group after routing, so routing would
have to tokenize separately to route on exact token ids; here the one rendering feeds both.
"""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from typing import Any

from fastapi import FastAPI

from flotilla.router.settings import IngressSettings, ServingConfig

# FrontendArgs that Flotilla sets itself (the listener, and API keys through api_keys_env).
RESERVED_FRONTEND_ARGS = frozenset({"host", "port", "api_key", "uds", "root_path"})
# vLLM routes Flotilla serves itself (its /health and /metrics cover every group), or that
# resize a single engine's data-parallel world, which means nothing across groups.
REPLACED_ROUTES = frozenset({"/health", "/metrics", "/scale_elastic_ep", "/is_scaling_elastic_ep"})
# Routes vLLM registers for every model but serves only when init_app_state built their handler (a state
# attribute, None when the model cannot): without one they answer 501 to anything, so they are dropped (404).
ROUTES_NEEDING_A_HANDLER = {"/v1/systemone": "serving_structured_decisions"}


def unknown_frontend_args(serving: ServingConfig) -> list[str]:
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    known = {f.name for f in dataclasses.fields(FrontendArgs)} - RESERVED_FRONTEND_ARGS
    return sorted(set(serving.extra_args) - known)


def serving_args(
    serving: ServingConfig, model_path: str, model_name: str, structured_outputs_config: Any = None
) -> Namespace:
    """``vllm serve``'s parsed arguments with Flotilla's serving config applied, checked as vLLM checks them.

    Raises ``ValueError`` or ``TypeError`` naming what is wrong (``flotilla serve`` calls it before starting).
    """
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    unknown = unknown_frontend_args(serving)
    if unknown:
        raise ValueError(f"serving.extra_args has fields vLLM's frontend does not know: {unknown}")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    flags = serving.model_dump(exclude={"api_keys_env", "extra_args"})
    for name, value in (flags | serving.extra_args).items():
        setattr(args, name, value)
    args.model = model_path
    args.served_model_name = [model_name]
    args.disable_log_stats = True  # engine statistics live in the groups
    args.api_key = None  # /v1 keys are checked by the ingress (OpenAI-shaped 401)
    if structured_outputs_config is not None:
        args.structured_outputs_config = structured_outputs_config
    validate_parsed_serve_args(args)
    return args


def check_parsers(serving: ServingConfig, tokenizer: str) -> None:
    """The tool and reasoning parsers exist and work with the model's tokenizer (vLLM's own startup check).

    A tool parser is checked as if auto tool choice were on, so a name that would fail later never starts.
    """
    from vllm.parser.parser_manager import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    if serving.tool_call_parser:
        ToolParserManager.get_tool_parser(serving.tool_call_parser)
    if serving.reasoning_parser:
        ReasoningParserManager.get_reasoning_parser(serving.reasoning_parser)
    if serving.tool_call_parser or serving.reasoning_parser:
        ParserManager.get_parser(
            tool_parser_name=serving.tool_call_parser,
            reasoning_parser_name=serving.reasoning_parser,
            enable_auto_tools=bool(serving.tool_call_parser),
            model_name=tokenizer,
            tokenizer=get_tokenizer(tokenizer),
        )


def frontend_config(settings: IngressSettings) -> Any:  # -> vllm.config.VllmConfig
    """The groups' model, tokenizer and structured-outputs settings, without an engine or a device."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from flotilla.cluster.engine import engine_kwargs, running_on_flotilla_cpu

    kwargs = engine_kwargs(settings.engine, running_on_flotilla_cpu()) | {"max_model_len": settings.max_model_len}
    engine_args = AsyncEngineArgs(**kwargs)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # no kernels run here (as in vLLM's render server)
    return VllmConfig(
        model_config=model_config,
        structured_outputs_config=engine_args.create_structured_outputs_config(),
    )


async def build_openai_app(args: Namespace, engine_client: Any) -> FastAPI:
    """vLLM's FastAPI app over ``engine_client``, without the routes the ingress serves itself."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    from flotilla.router.engine_client import SUPPORTED_TASKS

    app = build_app(args, SUPPORTED_TASKS, engine_client.model_config)
    await init_app_state(engine_client, app.state, args, SUPPORTED_TASKS)
    unserved = {path for path, handler in ROUTES_NEEDING_A_HANDLER.items() if getattr(app.state, handler, None) is None}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in REPLACED_ROUTES | unserved]
    app.state.server = None  # vLLM's engine-error handler reads it; no uvicorn server of vLLM's runs here
    return app
