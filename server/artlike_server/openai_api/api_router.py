"""HTTP glue of the OpenAI surface: routes, raw bodies in, bytes or SSE out. The logic is in `serving`.

    POST /v1/chat/completions              POST /t/{trajectory_id}/v1/chat/completions   (recorded)
    POST /v1/completions                   POST /t/{trajectory_id}/v1/completions        (recorded)
    POST /v1/responses                     POST /t/{trajectory_id}/v1/responses          (recorded; `dialects`)
    POST /v1/messages  (Anthropic)         POST /t/{trajectory_id}/v1/messages           (recorded; `dialects`)
    GET|DELETE /v1/responses/{response_id} (and under /t/{trajectory_id}/v1)               stored responses
    GET  /v1/models                        GET  /t/{trajectory_id}/v1/models
    GET  /v1/trajectories/{trajectory_id}  GET  /t/{trajectory_id}/v1/trajectory         -> TrajectoryRecord
    DELETE /v1/trajectories/{trajectory_id}                                                -> 204 (404 unknown)

POSTs to the completion paths are answered by `CompletionRoutes`, a pure ASGI middleware, before FastAPI's
exception middleware, dependency exit stack and route table (the same handlers are also routes, so other
methods get the router's 405). Bodies are read raw (no FastAPI body model): serving parses them once with
orjson and names the bad parameter itself. The `OpenAIServing` is the services' `serving` (it holds the request policy). A client that
disconnects cancels its request, which closes the engine connection: vLLM aborts the generation instead of
finishing it for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from artlike_server.errors import APIError, error_response
from artlike_server.openai_api.dialects import Dialect
from artlike_server.openai_api.dialects.responses import ResponsesDialect
from artlike_server.openai_api.protocol import Endpoint
from artlike_server.openai_api.serving import OpenAIServing
from artlike_server.openai_api.streaming import ProxyStream

router = APIRouter()

_T = TypeVar("_T")
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; never seen by anyone
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _serving(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.artlike.serving
    return serving


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await `work`, cancelling it if the client disconnects first (as vLLM's own `with_cancellation`).

    `work` runs in the calling task and one watcher task cancels it on a disconnect: a task and an
    `asyncio.wait` fewer per request than racing two tasks, on the proxy's hottest path.
    """
    current = asyncio.current_task()
    assert current is not None, "called outside a task"
    finished = disconnected = False

    async def cancel_when_client_goes() -> None:
        nonlocal disconnected
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not finished:  # never cancel a task whose work already returned: the cancel would hit its caller
            disconnected = True
            current.cancel()

    watcher = asyncio.create_task(cancel_when_client_goes())
    try:
        return await work
    except asyncio.CancelledError:
        if disconnected and current.uncancel() == 0:
            raise ClientDisconnected from None
        raise  # cancelled from outside (shutdown): not ours to swallow
    finally:
        finished = True  # runs before any other task can: nothing is awaited between `work` and here
        watcher.cancel()


class SSEResponse(StreamingResponse):
    """Streams a `ProxyStream` and always closes it, shielded, however the response ends.

    Starlette's StreamingResponse stops iterating on a disconnect but leaves the iterator to the garbage
    collector; closing it here is what aborts the engine request and records the partial completion.
    """

    def __init__(self, stream: ProxyStream) -> None:
        super().__init__(stream, media_type=stream.media_type, headers=_SSE_HEADERS)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as task_group:

                async def cancel_on_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    task_group.cancel_scope.cancel()

                task_group.start_soon(cancel_on_disconnect)
                await self.stream_response(send)
                task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()


async def _complete(request: Request, endpoint: Endpoint, trajectory_id: str | None) -> Response:
    raw_body = await request.body()
    try:
        result = await _unless_disconnected(
            request, _serving(request).create_completion(endpoint, raw_body, trajectory_id)
        )
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    return _answer(result)


async def _complete_translated(request: Request, dialect_name: str, trajectory_id: str | None) -> Response:
    dialect: Dialect = request.app.state.artlike.dialects[dialect_name]
    raw_body = await request.body()
    try:
        result = await _unless_disconnected(
            request, _serving(request).create_translated(dialect, raw_body, trajectory_id)
        )
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    except APIError as error:
        return error_response(error, dialect.error_body(error))
    return _answer(result)


def _answer(result: bytes | ProxyStream) -> Response:
    if isinstance(result, ProxyStream):
        return SSEResponse(result)
    return Response(result, media_type="application/json")


def _trajectory_id(request: Request) -> str | None:
    """The id in a trajectory-scoped path (`/t/{trajectory_id}/...`), None on the plain routes."""
    return request.path_params.get("trajectory_id")


async def chat_completions(request: Request) -> Response:
    return await _complete(request, "chat.completions", _trajectory_id(request))


async def completions(request: Request) -> Response:
    return await _complete(request, "completions", _trajectory_id(request))


async def responses(request: Request) -> Response:
    return await _complete_translated(request, "responses", _trajectory_id(request))


async def messages(request: Request) -> Response:
    return await _complete_translated(request, "messages", _trajectory_id(request))


async def list_models(request: Request) -> Response:
    return Response(await _serving(request).list_models(_trajectory_id(request)), media_type="application/json")


def _responses_dialect(request: Request) -> ResponsesDialect:
    dialect = request.app.state.artlike.dialects["responses"]
    assert isinstance(dialect, ResponsesDialect)
    return dialect


async def get_response(request: Request) -> Response:
    stored = await _responses_dialect(request).retrieve(request.path_params["response_id"])
    return Response(orjson.dumps(stored), media_type="application/json")


async def delete_response(request: Request) -> Response:
    deleted = await _responses_dialect(request).delete(request.path_params["response_id"])
    return Response(orjson.dumps(deleted), media_type="application/json")


async def get_trajectory(request: Request) -> Response:
    trajectory_id = request.path_params["trajectory_id"]
    return Response(await _serving(request).get_trajectory(trajectory_id), media_type="application/json")


async def delete_trajectory(request: Request) -> Response:
    await _serving(request).delete_trajectory(request.path_params["trajectory_id"])
    return Response(status_code=204)


@dataclass(frozen=True, slots=True)
class CompletionRoute:
    """A POST route that generates: an engine endpoint forwarded as is, or a dialect translated to chat."""

    endpoint: Endpoint | None = None
    dialect: str | None = None


_COMPLETION_PATHS: dict[str, CompletionRoute] = {
    "/v1/chat/completions": CompletionRoute(endpoint="chat.completions"),
    "/v1/completions": CompletionRoute(endpoint="completions"),
    "/v1/responses": CompletionRoute(dialect="responses"),
    "/v1/messages": CompletionRoute(dialect="messages"),
}


@dataclass(frozen=True, slots=True)
class RouteTemplate:
    """What `scope["route"]` needs for per-route metrics: the path template, as Starlette's routes have it."""

    path: str


def match_completion_path(path: str) -> tuple[RouteTemplate, CompletionRoute, str | None] | None:
    """The completion route a path names, with its route template and trajectory id; None for other paths.

    >>> match_completion_path("/t/run-7/v1/completions")
    (RouteTemplate(path='/t/{trajectory_id}/v1/completions'), CompletionRoute(endpoint='completions', dialect=None), 'run-7')
    """
    route = _COMPLETION_PATHS.get(path)
    if route is not None:
        return RouteTemplate(path), route, None
    if not path.startswith("/t/"):
        return None
    trajectory_id, slash, rest = path[3:].partition("/")
    route = _COMPLETION_PATHS.get("/" + rest)
    if not trajectory_id or not slash or route is None:
        return None
    return RouteTemplate("/t/{trajectory_id}/" + rest), route, trajectory_id


async def _complete_route(request: Request, route: CompletionRoute, trajectory_id: str | None) -> Response:
    if route.endpoint is not None:
        return await _complete(request, route.endpoint, trajectory_id)
    assert route.dialect is not None
    return await _complete_translated(request, route.dialect, trajectory_id)


class CompletionRoutes:
    """Answers POSTs to the completion paths itself; passes everything else on.

    Completions carry every token the proxy serves, and the layers FastAPI puts between its middleware and
    a route (exception middleware, dependency exit stack, route table, request/response wrapper) cost about
    a tenth of the proxy's CPU per request (A/B against a fake engine), and they wrap every streamed event's
    `send`. Add it first
    (innermost of the app's middleware), so the API key, body size and metrics middleware still see every
    request. `APIError`s are rendered here; anything else propagates to the server error middleware.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = match_completion_path(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        template, route, trajectory_id = match
        scope["route"] = template
        request = Request(scope, receive, send)
        try:
            response = await _complete_route(request, route, trajectory_id)
        except APIError as error:
            response = error_response(error)
        await response(scope, receive, send)


# Plain Starlette routes, not FastAPI's: nothing here uses dependency injection or body models (bodies are
# parsed once, by `serving`), and FastAPI's per-request dependency solving measured a third of the proxy's
# own CPU per completion. They are left out of the OpenAPI schema: the OpenAI API reference documents them.
for _path, _endpoint, _method in (
    ("/v1/chat/completions", chat_completions, "POST"),
    ("/t/{trajectory_id}/v1/chat/completions", chat_completions, "POST"),
    ("/v1/completions", completions, "POST"),
    ("/t/{trajectory_id}/v1/completions", completions, "POST"),
    ("/v1/responses", responses, "POST"),
    ("/t/{trajectory_id}/v1/responses", responses, "POST"),
    ("/v1/messages", messages, "POST"),
    ("/t/{trajectory_id}/v1/messages", messages, "POST"),
    ("/v1/responses/{response_id}", get_response, "GET"),
    ("/v1/responses/{response_id}", delete_response, "DELETE"),
    ("/t/{trajectory_id}/v1/responses/{response_id}", get_response, "GET"),
    ("/t/{trajectory_id}/v1/responses/{response_id}", delete_response, "DELETE"),
    ("/v1/models", list_models, "GET"),
    ("/t/{trajectory_id}/v1/models", list_models, "GET"),
    ("/v1/trajectories/{trajectory_id}", get_trajectory, "GET"),
    ("/v1/trajectories/{trajectory_id}", delete_trajectory, "DELETE"),
    ("/t/{trajectory_id}/v1/trajectory", get_trajectory, "GET"),
):
    router.add_route(_path, _endpoint, methods=[_method], include_in_schema=False)
