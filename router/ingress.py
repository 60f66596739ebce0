"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment wrapping a FastAPI app.

Request path: parse and validate → tokenize (chat template) → check the context window →
routing policy picks a group → stream from that group's leader actor → OpenAI JSON or SSE.
A client that disconnects has its engine request aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.group_api import (
    EngineErrorKind,
    GenerateChunk,
    GroupEngineError,
    GroupSnapshot,
    Membership,
)
from router.engine_metrics import merge_group_metrics
from router.group_directory import GroupDirectory, Member
from router.metrics import IngressMetrics
from router.openai_adapter import PreparedRequest, StreamTotals, prepare_chat, prepare_completion
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    bad_request,
)
from router.routing import Decision, NoRoutableGroup
from router.settings import IngressSettings
from router.tokenization import PromptTokenizer

logger = logging.getLogger(__name__)
RequestT = TypeVar("RequestT", bound=BaseModel)
SSE_DONE = b"data: [DONE]\n\n"
NO_GROUP_RETRY_AFTER_S = 5
ENGINE_METRICS_TIMEOUT_S = 2.0
COORDINATOR_TIMEOUT_S = 5.0


class RoutingUpdate(BaseModel):
    """Body of ``PUT /admin/routing``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    policy: str
    params: dict[str, Any] = {}


app = FastAPI(title="Flotilla", docs_url=None, redoc_url=None)


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, err: OpenAIError) -> JSONResponse:
    return error_response(err)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    return error_response(OpenAIError(err.status_code, str(err.detail), code=str(err.status_code)))


async def parse_body(request: Request, model: type[RequestT]) -> RequestT:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {first['ctx'].get('error', '')}") from None
        if first["type"] == "model_type":
            raise bad_request("the request body must be a JSON object") from None
        param = _param_path(first["loc"])
        raise bad_request(f"{param}: {first['msg']}", param) from None


_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: tuple[int | str, ...]) -> str:
    """``messages.0.content`` from pydantic's location, without union-member tags like ``list[int]``."""
    parts = [
        str(part) for part in loc if isinstance(part, int) or (part.isidentifier() and part not in _UNION_MEMBER_TAGS)
    ]
    return ".".join(parts)


def _engine_error(err: BaseException, group: str) -> OpenAIError:
    cause = err.cause if isinstance(err, RayTaskError) else err
    if isinstance(cause, GroupEngineError) and cause.kind is EngineErrorKind.BAD_REQUEST:
        return bad_request(cause.message)
    message = cause.message if isinstance(cause, GroupEngineError) else f"{type(cause).__name__}: {cause}"
    return OpenAIError(
        503,
        f"group {group} could not serve the request: {message}",
        type="service_unavailable",
        code="group_unavailable",
        headers={"Retry-After": str(NO_GROUP_RETRY_AFTER_S)},
    )


async def _prepend(
    first: GenerateChunk, rest: AsyncGenerator[GenerateChunk, None]
) -> AsyncGenerator[GenerateChunk, None]:
    yield first
    async for chunk in rest:
        yield chunk


GROUP_ACTIONS = frozenset({"drain", "resume", "restart"})


def group_json(group: GroupSnapshot) -> dict[str, Any]:
    return {
        "name": group.name,
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


def _sse_event(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


# Module-level helpers must be defined above this class: serve.ingress copies the class (and
# the globals its methods use) when the decorator runs.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, settings: IngressSettings) -> None:
        self.settings = settings
        self.tokenizer = PromptTokenizer(settings.model_path)
        self.directory = GroupDirectory.connect(settings)
        self.stats = IngressMetrics(membership=lambda: self.directory.membership)

    @app.get("/health")
    async def health(self) -> Response:
        """200 while at least one group is routable (the ingress itself is up either way)."""
        self.directory.ensure_started()
        ready = sorted(self.directory.router.group_names)
        if not ready:
            raise OpenAIError(
                503,
                "no replica group is ready",
                type="service_unavailable",
                code="no_ready_group",
                headers={"Retry-After": str(NO_GROUP_RETRY_AFTER_S)},
            )
        return JSONResponse({"status": "ok", "groups": ready})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        self.directory.ensure_started()
        router = self.directory.router
        self.stats.observe_groups(router.view(name) for name in router.group_names)
        engines = await self._engine_metrics()
        return Response(self.stats.render() + merge_group_metrics(engines), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"reset": await self.directory.reset_prefix_caches()})

    @app.put("/admin/routing")
    async def set_routing(self, request: Request) -> Response:
        self._authorize(request)
        body = await parse_body(request, RoutingUpdate)
        try:
            self.directory.set_policy(body.policy, body.params)
        except ValueError as err:
            raise bad_request(str(err), "policy") from None
        return JSONResponse({"policy": body.policy, "params": body.params})

    @app.get("/admin/groups")
    async def groups(self, request: Request) -> Response:
        self._authorize(request)
        try:
            call = self.directory.coordinator.get_membership.remote()
            membership = await asyncio.wait_for(asyncio.wrap_future(call.future()), COORDINATOR_TIMEOUT_S)
            available = True
        except Exception:  # the coordinator is restarting: what this replica routes by
            membership, available = self.directory.membership, False
        return JSONResponse(membership_json(membership) | {"coordinator_available": available})

    @app.post("/admin/groups/{group}/{action}")
    async def group_action(self, request: Request, group: str, action: str) -> Response:
        self._authorize(request)
        if action not in GROUP_ACTIONS:
            raise OpenAIError(404, f"unknown action {action!r}; one of {sorted(GROUP_ACTIONS)}", code="404")
        try:
            snapshot = await getattr(self.directory.coordinator, action).remote(group)
        except Exception as err:
            cause = err.cause if isinstance(err, RayTaskError) else err
            if isinstance(cause, KeyError):
                raise OpenAIError(404, str(cause.args[0]), param="group", code="group_not_found") from None
            if isinstance(cause, ValueError):
                raise OpenAIError(409, str(cause), param="group", code="conflict") from None
            raise OpenAIError(503, f"the coordinator did not answer: {cause}", type="service_unavailable") from None
        return JSONResponse(group_json(snapshot))

    def _authorize(self, request: Request) -> None:
        token = self.settings.admin_token
        if token is None:
            raise OpenAIError(404, "Not Found", code="404")
        if request.headers.get("authorization") != f"Bearer {token}":
            raise OpenAIError(401, "admin endpoints need the admin bearer token", type="authentication_error")

    async def _engine_metrics(self) -> dict[str, str]:
        """Each group's vLLM metrics; a group that does not answer in time is left out of this scrape."""
        names = list(self.directory.members)
        calls = [self.directory.members[name].leader.engine_metrics.remote() for name in names]
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.wrap_future(call.future()), ENGINE_METRICS_TIMEOUT_S) for call in calls),
            return_exceptions=True,
        )
        return {name: r.decode() for name, r in zip(names, results, strict=True) if isinstance(r, bytes)}

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.settings.model_name, max_model_len=self.settings.max_model_len)])

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions", CompletionRequest, prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat_completions", ChatCompletionRequest, prepare_chat)

    async def _serve(
        self,
        http_request: Request,
        endpoint: str,
        request_model: type[CompletionRequest] | type[ChatCompletionRequest],
        prepare: Callable[..., PreparedRequest],
    ) -> Response:
        arrived = time.perf_counter()
        chunks: AsyncGenerator[GenerateChunk, None] | None = None
        try:
            body = await parse_body(http_request, request_model)
            if body.model != self.settings.model_name:
                raise OpenAIError(
                    404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found"
                )
            prepared = prepare(body, self.tokenizer, self.settings.max_model_len, self.settings.model_name)
            chunks = self._generate(prepared)
            first = await anext(chunks)  # errors before the first token still get a proper status code
        except OpenAIError as err:
            self.stats.requests.labels(endpoint, str(err.status_code)).inc()
            return error_response(err)
        except BaseException:
            if chunks is not None:
                await chunks.aclose()
            raise
        if prepared.generate.stream:
            self.stats.time_to_first_token.labels(endpoint).observe(time.perf_counter() - arrived)
            events = self._sse(prepared, first, chunks, endpoint, arrived)
            return StreamingResponse(events, media_type="text/event-stream")
        totals, parts, last = StreamTotals(), [], first
        try:
            async for last in _prepend(first, chunks):
                totals.add(last)
                parts.append(last.text)
        except OpenAIError as err:
            self._count(endpoint, str(err.status_code), arrived)
            return error_response(err)
        finally:
            await chunks.aclose()
        self._count(endpoint, "200", arrived)
        body_out = prepared.formatter.full("".join(parts), last.finish_reason, totals)
        return Response(body_out.model_dump_json(), media_type="application/json")

    def _route(self, prepared: PreparedRequest, exclude: frozenset[str]) -> tuple[Decision, Member]:
        request = prepared.generate
        self.directory.ensure_started()
        try:
            decision, member = self.directory.route(request.request_id, request.prompt_token_ids, exclude)
        except NoRoutableGroup as err:
            raise OpenAIError(
                503,
                str(err),
                type="service_unavailable",
                code="no_ready_group",
                headers={"Retry-After": str(NO_GROUP_RETRY_AFTER_S)},
            ) from None
        self.stats.record_decision(self.directory.router.policy.name, decision)
        return decision, member

    async def _generate(self, prepared: PreparedRequest) -> AsyncGenerator[GenerateChunk, None]:
        """Chunks from a group. A group that fails before any chunk reached the client (non-streaming
        requests get a single final chunk) is reported to the coordinator and the request is retried
        on another group, up to ``failover.max_attempts`` groups."""
        request = prepared.generate
        failed: set[str] = set()
        while True:
            decision, member = self._route(prepared, frozenset(failed))
            output: list[int] = []
            delivered = False
            try:
                async for chunk in member.channel.generate(request):
                    if not output and chunk.token_ids:
                        self.directory.first_token(decision)
                    output += chunk.token_ids
                    delivered = True
                    yield chunk
                return
            except (RayTaskError, RayActorError, GroupEngineError) as err:
                error = _engine_error(err, member.name)
                if error.status_code == 400:
                    raise error from None
                self.directory.report_failure(member, str(error.message))
                failed.add(member.name)
                if delivered or len(failed) >= self.settings.failover.max_attempts:
                    raise error from None
                reason = err.kind.value if isinstance(err, GroupEngineError) else type(err).__name__
                self.stats.requests_retried.labels(reason).inc()
                logger.warning("request %s: %s; retrying on another group", request.request_id, error.message)
            finally:
                self.directory.finished(decision, output)
                self.stats.record_finished(member.name, len(request.prompt_token_ids), len(output))

    async def _sse(
        self,
        prepared: PreparedRequest,
        first: GenerateChunk,
        chunks: AsyncGenerator[GenerateChunk, None],
        endpoint: str,
        arrived: float,
    ) -> AsyncIterator[bytes]:
        totals = StreamTotals()
        formatter = prepared.formatter
        status = "200"
        try:
            is_first = True
            async for chunk in _prepend(first, chunks):
                totals.add(chunk)
                yield _sse_event(formatter.chunk(chunk.text, chunk.finish_reason, is_first))
                is_first = False
            if prepared.include_usage:
                yield _sse_event(formatter.usage_chunk(totals))
        except OpenAIError as err:
            status = str(err.status_code)
            yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.stats.aborted.labels(endpoint).inc()
            status = "499"
            raise
        finally:
            await chunks.aclose()
            self._count(endpoint, status, arrived)
        yield SSE_DONE

    def _count(self, endpoint: str, status: str, arrived: float) -> None:
        self.stats.requests.labels(endpoint, status).inc()
        self.stats.request_latency.labels(endpoint).observe(time.perf_counter() - arrived)
