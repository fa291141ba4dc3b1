"""The Starlette application: routes, error envelopes, API-key check."""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import ServerConfig
from ..engine.engine import Engine
from .chat import chat_completions
from .completions import completions
from .metrics import metrics_endpoint
from .errors import APIError
from .state import AppState

log = logging.getLogger("vlm_serve.api")


async def health(request: Request) -> JSONResponse:
    engine = request.app.state.vlm.engine
    return JSONResponse({"status": "ok", "in_flight": engine.in_flight})


async def models(request: Request) -> JSONResponse:
    state: AppState = request.app.state.vlm
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_id,
                    "object": "model",
                    "created": state.started,
                    "owned_by": "vlm-serve",
                    "max_model_len": state.max_model_len,
                }
            ],
        }
    )


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    request.app.state.vlm.metrics.requests.labels(f"rejected_{exc.status}").inc()
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    messages = {404: f"no route for {request.url.path}", 405: f"method {request.method} not allowed"}
    return APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)),
                    code="not_found" if exc.status_code == 404 else None,
                    headers=dict(exc.headers or {})).response()


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, "internal server error", code="internal_error").response()


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on /v1 routes when a key is set."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = APIError(401, "missing or invalid API key", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, config: ServerConfig) -> ASGIApp:
    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    app.state.vlm = AppState(engine, config)
    if config.api_key:
        return APIKeyMiddleware(app, config.api_key)
    return app
