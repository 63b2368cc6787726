"""The FastAPI app over a Server (the routers of routes.py behind one guard: the API key and the
body limit), and `serve`: uvicorn on a socket taken before the model loads."""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import KvliteError
from . import routes
from .config import ServeConfig
from .requests import ApiError
from .server import Server


def create_app(server: Server, load: bool = True) -> FastAPI:
    """The app. load: read the model in the background once serving starts (/health answers 503
    until then), unless the Server was given one."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if server.model is None and load:
            threading.Thread(target=server.load, name="kvlite-load", daemon=True).start()
        yield
        server.close()

    app = FastAPI(title="kvlite", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvlite = server
    app.include_router(routes.openai)
    app.include_router(routes.llama)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
    app.middleware("http")(guard)
    return app


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return JSONResponse(ApiError(400, f"bad request: {e.errors()[:1]}").body(), status_code=400)


async def internal_error(request: Request, e: Exception) -> JSONResponse:
    request.app.state.kvlite.metrics.error()
    return JSONResponse(ApiError(500, f"internal error: {e}", kind="server_error").body(), status_code=500)


async def guard(request: Request, call_next):
    """The API key (every endpoint but /health) and the body limit, before anything is read."""
    server: Server = request.app.state.kvlite
    try:
        if server.cfg.api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip().encode() if auth.startswith("Bearer ") else b""
            if not hmac.compare_digest(given, server.cfg.api_key.encode()):  # in constant time
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                               kind="authentication_error")  # fmt: skip
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > server.cfg.max_body):
            raise ApiError(413, f"the request body is over {server.cfg.max_body} bytes")
        if request.url.path != "/health" and server.model is None and request.method != "GET":
            raise server.not_ready()
    except ApiError as e:
        return await api_error(request, e)
    return await call_next(request)


class _Uvicorn(uvicorn.Server):
    """uvicorn, with the Server told of a shutdown as the signal arrives: the reply being made
    ends at its next token rather than running out its max_tokens while uvicorn waits."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.kvlite = server

    def handle_exit(self, sig, frame) -> None:
        self.kvlite.stopping = True
        super().handle_exit(sig, frame)


def serve(cfg: ServeConfig) -> int:
    """Serve until SIGINT or SIGTERM (uvicorn's graceful shutdown; exit status 0)."""
    server = Server(cfg)
    app = create_app(server)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", lifespan="on",
                            limit_concurrency=cfg.queue + 64, timeout_graceful_shutdown=10)  # fmt: skip
    uv = _Uvicorn(config, server)
    failed = []

    def watch_load() -> None:  # a model that cannot load ends the server, as llama-server does
        while server.model is None and server.load_error is None and not uv.should_exit:
            time.sleep(0.05)
        if server.load_error:
            failed.append(server.load_error)
            uv.should_exit = True

    sock = _bind(cfg.host, cfg.port)
    threading.Thread(target=watch_load, daemon=True).start()
    pool = f"one pool of {cfg.kv_cells} KV cells" if cfg.kv_cells else "a context a slot, one request at a time"
    print(f"kvlite serve: http://{cfg.host}:{cfg.port}/v1 (policy {cfg.policy}, {cfg.slots} slots, {pool})", flush=True)
    # uvicorn shuts down gracefully on Ctrl-C, then raises it again for whoever else wants it
    with contextlib.suppress(KeyboardInterrupt):
        uv.run(sockets=[sock])
    if failed:
        raise KvliteError(failed[0])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads: a port in use is a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise KvliteError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
