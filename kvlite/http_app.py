"""The HTTP face of `kvlite serve` (FastAPI, uvicorn, sse-starlette: the `serve` extra). It parses,
checks and formats; kvlite.serve.Server does the work. OpenAI's paths and shapes, llama-server's
/health, /tokenize, /detokenize, /slots and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from .api import check_text
from .errors import KvliteError
from .serve import ApiError, Ask, Result, ServeConfig, Server, Slot, _field, parse_messages, parse_request


def create_app(server: Server, load: bool = True):
    """The FastAPI app over a Server. load: read the model in the background once serving starts
    (/health answers 503 until then), unless the Server was given one."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if server.model is None and load:
            threading.Thread(target=server.load, name="kvlite-load", daemon=True).start()
        yield
        server.close()

    app = FastAPI(title="kvlite", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        if e.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return JSONResponse(ApiError(400, f"bad request: {e.errors()[:1]}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        server.metrics.errors += 1
        return JSONResponse(ApiError(500, f"internal error: {e}", kind="server_error").body(), status_code=500)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """The API key (every endpoint but /health) and the body limit, before anything is read."""
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
                raise _loading(server)
        except ApiError as e:
            return await api_error(request, e)
        return await call_next(request)

    async def body_of(request: Request) -> dict:
        data = bytearray()
        async for piece in request.stream():  # bounded even without a Content-Length
            data += piece
            if len(data) > server.cfg.max_body:
                raise ApiError(413, f"the request body is over {server.cfg.max_body} bytes")
        try:
            body = json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        if server.model is None:
            raise _loading(server)
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        if server.model is None:
            raise _loading(server)
        info = server.model.info
        meta = {"n_layer": info.n_layer, "n_ctx_train": info.n_ctx_train, "policy": server.cfg.policy,
                "budget": server.cfg.params.get("budget"), "evict": server.cfg.evict}  # fmt: skip
        data = [{"id": server.model_id, "object": "model", "created": int(server.started), "owned_by": "kvlite",
                 "meta": meta}]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        server.metrics.count("chat")
        messages = parse_messages(body)
        req = parse_request(body, server.cfg, server.default_sampling)
        return await respond(req, "chat.completion", lambda on_text, cancelled: server.chat(messages, req, on_text,
                                                                                            cancelled))  # fmt: skip

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        body = await body_of(request)
        server.metrics.count("completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (or a list of one)", param="prompt")
        try:
            check_text(prompt, "the prompt")  # as kvlite generate words it
        except KvliteError as e:
            raise ApiError(400, str(e), param="prompt") from None
        req = parse_request(body, server.cfg, server.default_sampling)
        return await respond(req, "text_completion", lambda on_text, cancelled: server.complete(prompt, req, on_text,
                                                                                               cancelled))  # fmt: skip

    async def respond(req: Ask, kind: str, work: Callable):
        """Run work(on_text, cancelled) on the worker; a JSON body, or SSE chunks as it generates."""
        ticket = server.enqueue()
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not req.stream:
            r = await server.run(ticket, lambda: work(None, lambda: server.stopping))
            server.metrics.add(r)
            return _response(kind, rid, created, server.model_id, r)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the server is stopping
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def on_text(text: str) -> None:
            if text:
                put(("text", text))

        async def produce():
            try:
                stop = lambda: cancel.is_set() or server.stopping  # noqa: E731
                r = await server.run(ticket, lambda: None if stop() else work(on_text, stop))
                if r is not None:  # None: the client left before it started
                    server.metrics.add(r)
                    put(("done", r))
            except ApiError as e:
                put(("error", e))
            except Exception as e:  # noqa: BLE001 - said to the client, which waits on this stream
                put(("error", ApiError(500, f"internal error: {e}", kind="server_error")))

        task = asyncio.ensure_future(produce())

        async def events():
            try:
                yield json.dumps(_chunk(kind, rid, created, server.model_id, "", role=True))
                while True:
                    what, value = await queue.get()
                    if what == "text":
                        yield json.dumps(_chunk(kind, rid, created, server.model_id, value))
                    elif what == "error":
                        yield json.dumps(value.body())
                        break
                    else:
                        last = _chunk(kind, rid, created, server.model_id, "", finish=value.finish_reason)
                        last["usage"], last["kvlite"] = _usage(value), value.kvlite
                        yield json.dumps(last)
                        break
                yield "[DONE]"
            finally:
                cancel.set()  # a client gone mid-stream stops its generation at the next token
                if not task.done():
                    await asyncio.shield(task)  # the slot is consistent again before the next request

        return EventSourceResponse(events(), ping=15)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", param="content")
        add_special = _field(body, "add_special", bool, False)
        parse_special = _field(body, "parse_special", bool, True)  # llama-server's default
        try:
            tokens = server.model.tokenize(content, add_special=add_special, parse_special=parse_special)
        except KvliteError as e:
            raise ApiError(400, str(e)) from None
        if _field(body, "with_pieces", bool, False):
            return {"tokens": [{"id": t, "piece": server.model.detokenize([t], special=True)} for t in tokens]}
        return {"tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        tokens = body.get("tokens")
        n_vocab = server.model.n_vocab
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < n_vocab for t in tokens):
            raise ApiError(400, f"'tokens' must be a list of token ids in 0..{n_vocab - 1}", param="tokens")
        return {"content": server.model.detokenize(tokens, special=True)}  # as llama-server

    @app.get("/slots")
    async def slots():
        return [_slot_state(s) for s in server.slots]

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: str, request: Request, action: str = ""):
        """llama-server's slot files: ?action=save|restore with {"filename": ...}, or ?action=erase."""
        if not slot_id.isdigit():
            raise ApiError(400, f"no slot '{slot_id}'")
        body = await body_of(request) if action in ("save", "restore") else {}
        jobs = {"save": lambda: server.save_slot(int(slot_id), body.get("filename")),
                "restore": lambda: server.restore_slot(int(slot_id), body.get("filename")),
                "erase": lambda: server.erase_slot(int(slot_id))}  # fmt: skip
        if action not in jobs:
            raise ApiError(400, "'action' must be save, restore or erase", param="action")
        return await server.run(server.enqueue(), jobs[action])

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(server), media_type="text/plain; version=0.0.4")

    return app


def _loading(server: Server) -> ApiError:
    if server.load_error:
        return ApiError(500, f"the model could not be loaded: {server.load_error}", kind="server_error")
    return ApiError(503, "Loading model", kind="unavailable_error")


def _usage(r: Result) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.kvlite["reused_tokens"]}}  # fmt: skip


def _response(kind: str, rid: str, created: int, model: str, r: Result) -> dict:
    if kind == "chat.completion":
        choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason}
    else:
        choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice], "usage": _usage(r),
            "kvlite": r.kvlite}  # fmt: skip


def _chunk(kind: str, rid: str, created: int, model: str, text: str, role: bool = False,
           finish: str | None = None) -> dict:  # fmt: skip
    if kind == "chat.completion":
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def _slot_state(s: Slot) -> dict:
    conv = s.conversation
    cache = conv.runner.cache if conv else None
    return {
        "id": s.id,
        "conversation_id": s.conversation_id,
        "policy": repr(conv.runner.policy) if conv else None,
        "budget": conv.runner.policy.budget if conv else None,
        "messages": len(s.messages),
        "n_pos": cache.n_pos if cache else 0,
        "resident_cells": cache.n_resident if cache else 0,
        "evicted_cells": cache.evicted if cache else 0,
        "requests": s.requests,
        "last_used": s.last_used or None,
    }


def _prometheus(server: Server) -> str:
    """Prometheus' text format: the counters, then per slot its cells, budget and evictions."""
    m = server.metrics
    with m.lock:
        by_endpoint = [(f'{{endpoint="{k}"}}', v) for k, v in sorted(m.requests.items())] or [('{endpoint="chat"}', 0)]
        rows = [
            ("requests_total", "counter", "Requests, by endpoint.", by_endpoint),
            ("requests_rejected_total", "counter", "Requests answered 503: the queue was full.", [("", m.rejected)]),
            ("errors_total", "counter", "Requests that failed inside the server (500).", [("", m.errors)]),
            ("requests_waiting", "gauge", "Requests queued behind the one running.", [("", max(server.active - 1, 0))]),
            ("prompt_tokens_total", "counter", "Prompt tokens of the requests answered.", [("", m.prompt_tokens)]),
            ("prefilled_tokens_total", "counter", "Prompt tokens prefilled (the rest came from a slot's cache).",
             [("", m.prefilled_tokens)]),
            ("completion_tokens_total", "counter", "Tokens generated.", [("", m.completion_tokens)]),
            ("prefill_tokens_per_second", "gauge", "Prefill throughput over all requests.",
             [("", m.prefilled_tokens / m.prefill_s if m.prefill_s else 0)]),
            ("decode_tokens_per_second", "gauge", "Decode throughput over all requests.",
             [("", m.completion_tokens / m.decode_s if m.decode_s else 0)]),
        ]  # fmt: skip
    slots = [(f'{{slot="{s.id}"}}', _slot_state(s)) for s in server.slots]
    rows += [
        ("slot_resident_cells", "gauge", "KV cells resident in a slot's cache.",
         [(label, st["resident_cells"]) for label, st in slots]),
        ("slot_budget_cells", "gauge", "A slot's KV budget (0: none).",
         [(label, st["budget"] or 0) for label, st in slots]),
        ("slot_evicted_cells_total", "counter", "KV cells a slot's conversation has evicted.",
         [(label, st["evicted_cells"]) for label, st in slots]),
    ]  # fmt: skip
    lines = []
    for name, kind, doc, samples in rows:
        lines += [f"# HELP kvlite_{name} {doc}", f"# TYPE kvlite_{name} {kind}"]
        lines += [f"kvlite_{name}{labels} {value}" for labels, value in samples]
    return "\n".join(lines) + "\n"


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
    print(f"kvlite serve: http://{cfg.host}:{cfg.port}/v1 (policy {cfg.policy}, {cfg.slots} slots)", flush=True)
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
