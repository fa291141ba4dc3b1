"""The Starlette application: routes, error envelopes, API-key check, access log."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import ServerConfig
from ..engine.engine import Engine, request_record
from .anthropic_messages import MESSAGES_PATH, error_response as anthropic_error, is_messages_path
from .anthropic_messages import messages as anthropic_messages
from .chat import chat_completions
from .completions import completions
from .metrics import metrics_endpoint
from .tokenize import detokenize_endpoint, tokenize_endpoint
from .openai_responses import responses
from .errors import APIError
from .state import AppState

log = logging.getLogger("vlm_serve.api")
access_log = logging.getLogger("vlm_serve.access")


async def health(request: Request) -> JSONResponse:
    engine = request.app.state.vlm.engine
    body = {"status": "ok", "in_flight": engine.in_flight}
    parallel = getattr(engine, "parallel", None)
    if parallel is not None:  # a tensor-parallel group: its ranks, and why it failed
        body["tensor_parallel"] = parallel.health()
        if parallel.failed:
            body["status"] = "error"
            return JSONResponse(body, status_code=503)
    return JSONResponse(body)


def _model_card(state: AppState) -> dict:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "vlm-serve",
        "max_model_len": state.max_model_len,
    }


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.vlm)]})


async def model(request: Request) -> JSONResponse:
    state: AppState = request.app.state.vlm
    model_id = request.path_params["model_id"]
    if model_id not in (state.model_id, state.config.model):
        raise APIError(404, f"model {model_id!r} is not served here (serving {state.model_id!r})",
                       param="model", code="model_not_found")
    return JSONResponse(_model_card(state))


def _error_response(path: str, exc: APIError) -> JSONResponse:
    """Anthropic's error shape on its Messages route, OpenAI's everywhere else."""
    return anthropic_error(exc) if is_messages_path(path) else exc.response()


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    request.app.state.vlm.metrics.rejected(exc.status)
    return _error_response(request.url.path, exc)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    messages = {404: f"no route for {request.url.path}", 405: f"method {request.method} not allowed"}
    return _error_response(request.url.path, APIError(
        exc.status_code, messages.get(exc.status_code, str(exc.detail)),
        code="not_found" if exc.status_code == 404 else None, headers=dict(exc.headers or {})))


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return _error_response(request.url.path, APIError(500, "internal server error", code="internal_error"))


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on
    /v1 routes, /tokenize and /detokenize when a key is set."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/tokenize", "/detokenize")):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            x_api_key = b"Bearer " + headers.get(b"x-api-key", b"")
            # `|`, not `or`: both are compared every time, in constant time.
            if not (hmac.compare_digest(given, self.expected) | hmac.compare_digest(x_api_key, self.expected)):
                error = APIError(401, "missing or invalid API key", code="invalid_api_key")
                response = _error_response(scope["path"], error)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GuardMiddleware:
    """Refuse what must not reach a route: any request once the server is draining
    (503), and a body framed by both Content-Length and Transfer-Encoding, the
    request-smuggling shape (400 and close the connection, RFC 9112 section 6.3)."""

    def __init__(self, app: ASGIApp, engine: Engine):
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                error = APIError(400, "both Content-Length and Transfer-Encoding are set",
                                 code="invalid_framing", headers={"Connection": "close"})
                await _error_response(scope["path"], error)(scope, receive, send)
                return
            if self.engine.draining:
                error = APIError(503, "the server is shutting down", code="shutting_down",
                                 headers={"Connection": "close"})
                await _error_response(scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AccessLogMiddleware:
    """One line per request, written when its response ends (a stream: when the
    stream ends), with the request id and token counts where a generation ran."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500  # what the client sees if the app fails before responding
        record: dict = {}
        token = request_record.set(record)

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            request_record.reset(token)
            client = scope.get("client") or ("-", 0)
            access_log.info(
                '%s:%s "%s %s" %d %.1fms id=%s prompt_tokens=%s completion_tokens=%s',
                client[0], client[1], scope["method"], scope["path"], status,
                (time.monotonic() - started) * 1000, record.get("request_id", "-"),
                record.get("prompt_tokens", "-"), record.get("completion_tokens", "-"),
            )


def create_app(engine: Engine, config: ServerConfig) -> Starlette:
    # Outermost first: the access log sees every answer, the guard's and the key's too.
    middleware = [Middleware(AccessLogMiddleware)] if config.access_log else []
    if config.allowed_origins:
        # Outside the key check: a browser's preflight carries no credentials. Any
        # request header is allowed (SDKs send their own x-* headers); no cookies.
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
        ))
    middleware.append(Middleware(GuardMiddleware, engine=engine))
    if config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key))
    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route(MESSAGES_PATH, anthropic_messages, methods=["POST"]),
            Route("/tokenize", tokenize_endpoint, methods=["POST"]),
            Route("/detokenize", detokenize_endpoint, methods=["POST"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        middleware=middleware,
    )
    app.state.vlm = AppState(engine, config)
    return app
