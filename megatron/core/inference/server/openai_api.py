"""The OpenAI-compatible HTTP API on top of an :class:`InferenceClient`.

``build_app(client, tokenizer, config)`` returns a FastAPI app with /v1/completions,
/v1/chat/completions, /v1/models (and /v1/models/{id}), /tokenize, /detokenize, /version, /health
and /metrics; /v1/embeddings answers 404 (no engine computes embeddings). Each HTTP request becomes one
engine request per choice, at most ``config.max_in_flight_per_request`` of them at a time
(see :class:`~megatron.core.inference.server.service.ChoiceSet`). A request is admitted only
once the choices of that first window have their first output, so admission errors get a
proper status even for streams. A client that disconnects or closes its stream aborts its
engine requests (a whole request then answers 499, counted in /metrics as abandoned).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import megatron
from megatron.core.inference.coordinator.client import InferenceClient
from megatron.core.inference.server.chat import chat_completions
from megatron.core.inference.server.completions import completions
from megatron.core.inference.server.errors import APIError, install_error_handlers
from megatron.core.inference.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from megatron.core.inference.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestCounterMiddleware
from megatron.core.inference.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from megatron.core.inference.server.service import OpenAIService, ServerConfig
from megatron.core.inference.server.streaming import until_disconnected
from megatron.core.inference.server.tokens import detokenize, tokenize
from megatron.core.tokenizers import build_tokenizer


def build_app(client: InferenceClient, tokenizer=None, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``client``; the app starts the client on startup and closes it on shutdown."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = config or ServerConfig()
    service = OpenAIService(client, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="Megatron OpenAI-compatible server", lifespan=lifespan)
    app.state.service = service
    app.state.server_config = config  # serve.py reads its connection options
    install_error_handlers(app)
    _add_routes(app, service)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes, timeout_s=config.body_timeout_s)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    paths = frozenset(route.path for route in app.routes)
    app.add_middleware(RequestCounterMiddleware, metrics=service.metrics, paths=paths)
    return app


def _add_routes(app: FastAPI, service: OpenAIService) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        state = service.client.health()  # 503 when the coordinator or every engine is gone
        if not state.ok:
            return APIError(503, state.problem, type="server_error", code="unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await service.client.stats(timeout_s=1.0)
        except Exception:  # noqa: BLE001 - metrics stay available when the coordinator is not
            stats = None
        return Response(service.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [service.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        service.check_model(model_id)
        return JSONResponse(service.model_card())

    @app.post("/v1/embeddings")
    async def embeddings() -> JSONResponse:
        raise APIError(
            404,
            "this server does not compute embeddings: /v1/embeddings is not supported (only generation is)",
            code="unsupported_endpoint",
        )

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": megatron.__version__})

    @app.post("/tokenize")
    async def _tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenize(service, body))

    @app.post("/detokenize")
    async def _detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(detokenize(service, body))

    @app.post("/v1/completions")
    async def _completions(body: CompletionRequest, request: Request) -> Response:
        return await until_disconnected(request, completions(service, body))

    @app.post("/v1/chat/completions")
    async def _chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await until_disconnected(request, chat_completions(service, body))
