"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment serving vLLM's own frontend.

Each replica builds vLLM's FastAPI app (``router.frontend``) over a routed engine client
(``router.engine_client``), so every ``/v1`` route, request model and response shape is
vLLM's. Flotilla adds what spans the groups: ``/health`` (some group ready), ``/metrics``
(ingress and every group's engine), the admin API, API keys with OpenAI-shaped 401s, request
metrics, and ``Retry-After`` on every 503.
"""

# No `from __future__ import annotations`: Serve pickles this class by value, and FastAPI must find
# the route handlers' parameter types (Request, RoutingUpdate) as objects, not as names to look up.
import asyncio
import dataclasses
import secrets
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.exceptions import RayTaskError
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flotilla.cluster.contract import GroupSnapshot, Membership, RoutingChoice
from flotilla.cluster.engine import settle_after_startup
from flotilla.router.api_keys import API_PREFIXES, ApiKeyMiddleware, KeyFileFollower, KeyRing
from flotilla.router.engine_client import REQUEST_CONTEXT, RequestContext, RoutedEngineClient
from flotilla.router.engine_metrics import merge_group_metrics
from flotilla.router.frontend import build_openai_app, frontend_config, serving_args
from flotilla.router.group_directory import GroupDirectory
from flotilla.router.metrics import IngressMetrics
from flotilla.router.policies import make_policy
from flotilla.router.replica_metrics import serve_replica_metrics
from flotilla.router.settings import IngressSettings

NO_GROUP_RETRY_AFTER_S = 5
ENGINE_METRICS_TIMEOUT_S = 2.0
COORDINATOR_TIMEOUT_S = 5.0
GROUP_ACTIONS = frozenset({"drain", "resume", "restart"})


class RoutingUpdate(BaseModel):
    """Body of ``PUT /admin/routing``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    policy: str
    params: dict[str, Any] = {}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in the shape vLLM's serving layer uses (OpenAI's ``{"error": {...}}``)."""
    from http import HTTPStatus

    body = {"error": {"message": message, "type": HTTPStatus(status).phrase, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def unauthorized() -> JSONResponse:
    return error_response(401, "a valid API key is required: Authorization: Bearer KEY")


def group_json(group: GroupSnapshot) -> dict[str, Any]:
    return {
        "name": group.name,
        "gang": group.gang or group.name,
        "state": group.state.value,
        "generation": group.generation,
        "detail": group.detail,
        "since": group.since,
        "restarts": group.restarts,
        "last_failure": group.last_failure,
        "instance_id": group.instance_id,
    }


def membership_json(membership: Membership) -> dict[str, Any]:
    return {
        "version": membership.version,
        "coordinator_started_at": membership.coordinator_started_at,
        "groups": [group_json(g) for g in membership.groups],
        "events": [dataclasses.asdict(e) for e in membership.events],
    }


def endpoint_name(path: str) -> str:
    """The ``endpoint`` label of a request path: ``/v1/chat/completions`` → ``chat_completions``."""
    return path.removeprefix("/v1/").strip("/").replace("/", "_") or "root"


class IngressMiddleware:
    """Per request: the context the engine client reads, status and latency metrics, ``Retry-After`` on 503s."""

    def __init__(self, app: ASGIApp, stats: IngressMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.stats = stats
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_name(scope["path"]) if scope["path"] in self.endpoints else "other"
        context = RequestContext(endpoint, time.perf_counter())
        status = "499"  # the client went away before any answer

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
                if message["status"] == 503:
                    MutableHeaders(scope=message).setdefault("Retry-After", str(NO_GROUP_RETRY_AFTER_S))
            await send(message)

        token = REQUEST_CONTEXT.set(context)
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            REQUEST_CONTEXT.reset(token)
            if endpoint != "other":
                self.stats.requests.labels(endpoint, status).inc()
                self.stats.request_latency.labels(endpoint).observe(time.perf_counter() - context.arrived)


def openapi_document(app: FastAPI, openai_app: FastAPI) -> dict[str, Any]:
    """One OpenAPI document for every route: Flotilla's own (``app``) and vLLM's (mounted, which FastAPI
    leaves out of the outer app's document)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        own = get_openapi(title=app.title, version=app.version, routes=app.routes)
        theirs = openai_app.openapi()
        own["paths"] = theirs.get("paths", {}) | own.get("paths", {})
        schemas = theirs.get("components", {}).get("schemas", {}) | own.get("components", {}).get("schemas", {})
        own["components"] = own.get("components", {}) | {"schemas": schemas}
        app.openapi_schema = own
    return app.openapi_schema


SERVE_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
"""Environment of every ingress replica (``flotilla.launcher`` deploys it with this): the app runs on the
replica's own event loop, beside Serve's HTTP server, as vLLM's API server runs on one loop. Serve's default,
a second loop in a thread for user code, handed every streamed chunk across with ``call_soon_threadsafe`` (a
wake-up of the other loop each): 11 % of a replica's Python under 2-group load; with one loop the replica's CPU
per request was 0.84× (3 starts each, alternated, 2026-12-07). The thread guards Serve's loop against user code
that blocks; this app keeps off its loop what would (vLLM's renderer tokenizes in a thread pool)."""


# Module-level helpers must be defined above this class: serve.ingress copies the class (and
# the globals its methods use) when the decorator runs.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, settings: IngressSettings) -> None:  # type: ignore[misc]  # Serve awaits it
        from vllm.renderers import renderer_from_config

        self.directory = await GroupDirectory.connect(settings)  # may wait for the first group to be ready
        self.settings = settings = self.directory.settings
        replica = serve.get_replica_context()
        self.stats = IngressMetrics(membership=lambda: self.directory.membership, replica=replica.replica_id.unique_id)
        self._replica_metrics: asyncio.Task[None] | None = None
        self.api_keys = KeyRing(settings.api_keys)
        self._key_file: asyncio.Task[None] | None = None
        if settings.api_keys_file is not None:
            self._key_file = asyncio.create_task(KeyFileFollower(settings.api_keys_file, self.api_keys).follow())
        if settings.metrics_port is not None:
            port = settings.metrics_port + replica.rank.local_rank
            self._replica_metrics = asyncio.create_task(
                serve_replica_metrics(settings.metrics_host, port, self._render_replica_metrics)
            )
        # Building vLLM's config loads the tokenizer and model config: off the event loop.
        vllm_config = await asyncio.to_thread(frontend_config, settings)
        self.args = serving_args(
            settings.serving, settings.model_path, settings.model_name, vllm_config.structured_outputs_config
        )
        renderer = renderer_from_config(vllm_config)
        self.engine = RoutedEngineClient(
            vllm_config, renderer, self.directory, self.stats, settings.failover.max_attempts
        )

    async def __serve_build_asgi_app__(self) -> FastAPI:
        """Flotilla's routes and middleware around vLLM's app, which serves every other path."""
        from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

        openai_app = await build_openai_app(self.args, self.engine)
        app = FastAPI(title="Flotilla", docs_url=None, redoc_url=None)
        app.openapi = lambda: openapi_document(app, openai_app)  # type: ignore[method-assign]
        app.state.args = self.args  # vLLM's exception handlers read it; ours answer in the same shape
        init_exception_handler(app)
        app.include_router(self._routes())
        app.mount("/", openai_app)
        if self.settings.api_keys or self.settings.api_keys_file:
            app.add_middleware(ApiKeyMiddleware, ring=self.api_keys, unauthorized=unauthorized)
        endpoints = frozenset(
            path for route in openai_app.router.routes if (path := getattr(route, "path", "")).startswith(API_PREFIXES)
        )
        app.add_middleware(IngressMiddleware, stats=self.stats, endpoints=endpoints)  # outermost: sees every answer
        settle_after_startup()  # without it a full collection paused each replica for 955 ms (2026-12-06)
        return app

    def _routes(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/metrics", self.metrics, methods=["GET"])
        router.add_api_route("/admin/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])
        router.add_api_route("/admin/routing", self.set_routing, methods=["PUT"])
        router.add_api_route("/admin/groups", self.groups, methods=["GET"])
        router.add_api_route("/admin/groups/{group}/{action}", self.group_action, methods=["POST"])
        return router

    async def health(self) -> Response:
        """200 while at least one group is routable (the ingress itself is up either way)."""
        self.directory.ensure_started()
        ready = sorted(self.directory.router.group_names)
        if not ready:
            return error_response(503, "no replica group is ready")
        return JSONResponse({"status": "ok", "groups": ready})

    async def metrics(self, scope: str = "all") -> Response:
        """Everything; ``?scope=cluster``: only what every replica reports alike (the replicas' own series are
        then scraped from each replica's metrics port)."""
        if scope not in ("all", "cluster"):
            return error_response(400, f"unknown scope {scope!r}; one of ['all', 'cluster']", "scope")
        own = self._render_replica_metrics() if scope == "all" else b""
        engines = await self._engine_metrics()
        body = own + self.stats.render_cluster() + merge_group_metrics(engines)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _render_replica_metrics(self) -> bytes:
        self.directory.ensure_started()
        router = self.directory.router
        self.stats.observe_groups(router.view(name) for name in router.group_names)
        return self.stats.render_replica()

    async def reset_prefix_cache(self, request: Request) -> Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        return JSONResponse({"reset": await self.directory.reset_prefix_caches()})

    async def set_routing(self, request: Request, body: RoutingUpdate) -> Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        choice = RoutingChoice(body.policy, body.params)
        try:
            make_policy(choice.policy, choice.params)
        except ValueError as err:
            return error_response(400, str(err), "policy")
        # Through the coordinator: it keeps the choice and every replica (this one too) takes it from membership.
        try:
            call = self.directory.coordinator.set_routing.remote(choice)
            await asyncio.wait_for(asyncio.wrap_future(call.future()), COORDINATOR_TIMEOUT_S)
        except Exception as err:
            return error_response(503, f"the coordinator did not answer; routing is unchanged: {err}")
        self.directory.set_policy(choice)  # this replica at once, before its next snapshot arrives
        return JSONResponse({"policy": choice.policy, "params": choice.params})

    async def groups(self, request: Request) -> Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        try:
            call = self.directory.coordinator.get_membership.remote()
            membership = await asyncio.wait_for(asyncio.wrap_future(call.future()), COORDINATOR_TIMEOUT_S)
            available = True
        except Exception:  # the coordinator is restarting: what this replica routes by
            membership, available = self.directory.membership, False
        return JSONResponse(membership_json(membership) | {"coordinator_available": available})

    async def group_action(self, request: Request, group: str, action: str) -> Response:
        if (denied := self._authorize(request)) is not None:
            return denied
        if action not in GROUP_ACTIONS:
            return error_response(404, f"unknown action {action!r}; one of {sorted(GROUP_ACTIONS)}", "action")
        try:
            snapshot = await getattr(self.directory.coordinator, action).remote(group)
        except Exception as err:
            cause = err.cause if isinstance(err, RayTaskError) else err
            if isinstance(cause, KeyError):
                return error_response(404, str(cause.args[0]), "group")
            if isinstance(cause, ValueError):
                return error_response(409, str(cause), "group")
            return error_response(503, f"the coordinator did not answer: {cause}")
        return JSONResponse(group_json(snapshot))

    def _authorize(self, request: Request) -> Response | None:
        token = self.settings.admin_token
        if token is None:
            return error_response(404, "Not Found")
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error_response(401, "admin endpoints need the admin bearer token")
        return None

    async def _engine_metrics(self) -> dict[str, str]:
        """Each group's vLLM metrics; a group that does not answer in time is left out of this scrape."""
        names = list(self.directory.members)
        calls = [self.directory.members[name].leader.engine_metrics.remote() for name in names]
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.wrap_future(call.future()), ENGINE_METRICS_TIMEOUT_S) for call in calls),
            return_exceptions=True,
        )
        return {name: r.decode() for name, r in zip(names, results, strict=True) if isinstance(r, bytes)}
