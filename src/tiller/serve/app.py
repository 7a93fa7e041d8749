"""The `tiller serve` app: `create_app(engine, tokenizer, settings)` builds a FastAPI app over
one engine, with SGLang-style routes in tiller's dialect (`native`), the OpenAI-compatible ones
(`openai_routes`), the control routes, and errors in OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiller.serve import native
from tiller.serve.guard import Guard, reply
from tiller.serve.openai_routes import add_openai_routes
from tiller.serve.protocol import APIError, EmptyRequest, read_body
from tiller.serve.server import Server, ServeSettings

logger = logging.getLogger(__name__)


def create_app(engine: Any, tokenizer: Any, settings: ServeSettings) -> FastAPI:
    """The app over `engine` (an `EmbeddedEngine`); the engine is closed when the app stops."""
    server = Server(engine, tokenizer, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="tiller serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.add_middleware(Guard, api_keys=settings.api_keys, hosts=settings.hosts,
                       max_body_bytes=settings.max_body_bytes)
    app.add_middleware(CatchAll)  # added last: the outermost, so it sees every exception

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        s = settings
        return {"model_path": s.model_path, "tokenizer_path": s.model_path, "is_generation": True,
                "max_context": server.max_context, "max_prompt_tokens": server.max_prompt_tokens,
                "weight_version": engine.version, "dtype": s.dtype, "device": s.device,
                "vocab_size": server.vocab_size, "stop_token_ids": list(s.stop_token_ids),
                "max_batch_size": engine.max_batch_size, "max_n": s.max_n,
                "max_body_bytes": s.max_body_bytes, "max_json_values": s.max_json_values,
                "weights_root": s.weights_root is not None,
                "boot_id": server.boot_id}

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        return await native.generate(server, request)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        return await native.update_weights(server, request)

    @app.post("/score")
    async def score(request: Request) -> dict[str, Any]:
        return await native.score(server, request)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        return await native.abort(server, request)

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> dict[str, Any]:
        await read_body(request, EmptyRequest)
        return {"success": True, "entries_dropped": await asyncio.to_thread(engine.flush_cache)}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        await read_body(request, EmptyRequest)
        await asyncio.to_thread(engine.pause)
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, Any]:
        await read_body(request, EmptyRequest)
        await asyncio.to_thread(engine.resume)
        return {"success": True}

    add_openai_routes(app, server)
    return app


class CatchAll:
    """ASGI middleware: an exception no route handled is logged and answered as a JSON 500
    here, and not re-raised, so uvicorn keeps the connection (Starlette's catch-all handler
    re-raises after answering, and uvicorn then drops the kept-alive connection)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:  # the client left before its body arrived: nobody to answer
            logger.debug("%s %s: the client disconnected", scope["method"], scope["path"])
        except Exception as e:
            logger.error("%s %s failed", scope["method"], scope["path"], exc_info=e)
            if started:  # half an answer is out: only dropping the connection says it failed
                raise
            await reply(send, APIError(500, f"internal error: {type(e).__name__}"))
