"""The endpoints, as FastAPI routers: OpenAI's (`openai`: models, chat completions, completions)
and llama-server's (`llama`: /health, /tokenize, /detokenize, /slots, /metrics). Each reads its
body, has it parsed (requests.py), runs the work through the admission (server.py) and formats
the answer in OpenAI's shapes, as JSON or server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from sse_starlette.sse import EventSourceResponse

from ..errors import KvliteError
from .requests import (
    ApiError,
    Ask,
    parse_body,
    parse_detokenize,
    parse_messages,
    parse_prompt,
    parse_request,  # fmt: skip
    parse_slot_action,
    parse_tokenize,
)
from .server import Result, Server

openai = APIRouter()
llama = APIRouter()


def kvlite_server(request: Request) -> Server:
    return request.app.state.kvlite


Served = Annotated[Server, Depends(kvlite_server)]  # the app's Server, handed to each endpoint


async def body_of(request: Request, server: Server) -> dict:
    data = bytearray()
    async for piece in request.stream():  # bounded even without a Content-Length
        data += piece
        if len(data) > server.cfg.max_body:
            raise ApiError(413, f"the request body is over {server.cfg.max_body} bytes")
    return parse_body(bytes(data))


# -- OpenAI ---------------------------------------------------------------------------------------
@openai.get("/v1/models")
@openai.get("/models")
async def models(server: Served):
    if server.model is None:
        raise server.not_ready()
    info, cfg = server.model.info, server.cfg
    meta = {"n_layer": info.n_layer, "n_ctx_train": info.n_ctx_train, "policy": cfg.policy,
            "budget": cfg.params.get("budget"), "evict": cfg.evict}  # fmt: skip
    data = [{"id": server.model_id, "object": "model", "created": int(server.started), "owned_by": "kvlite",
             "meta": meta}]  # fmt: skip
    return {"object": "list", "data": data}


@openai.post("/v1/chat/completions")
@openai.post("/chat/completions")
async def chat_completions(request: Request, server: Served):
    return await completion(request, server, "chat", parse_messages, server.chat)


@openai.post("/v1/completions")
@openai.post("/completions")
async def completions(request: Request, server: Served):
    return await completion(request, server, "completions", parse_prompt, server.complete)


async def completion(request: Request, server: Server, endpoint: str, parse_input: Callable, work: Callable):
    """Both completion endpoints: the body, the endpoint's own input (messages or a prompt), then
    what they share (parse_request), and work(input, request, on_text, cancelled) answered."""
    body = await body_of(request, server)
    server.metrics.count(endpoint)
    given = parse_input(body)
    if endpoint == "completions" and body.get("kv_recall"):
        raise ApiError(400, "kv_recall brings evicted cells back to a conversation's next turn: a completion has "
                       "none (use /v1/chat/completions)", param="kv_recall")  # fmt: skip
    req = parse_request(body, server.cfg, server.default_sampling)
    if req.policy.share:  # in cells before a stream's 200, so that a share that cannot run is a 400
        req = server.for_prompt(given, req)
    kind = "chat.completion" if endpoint == "chat" else "text_completion"
    return await respond(server, req, kind, lambda on_text, cancelled: work(given, req, on_text, cancelled))


async def respond(server: Server, req: Ask, kind: str, work: Callable):
    """Run work(on_text, cancelled) through the admission; a JSON body, or SSE chunks as it generates."""
    ticket = server.admission.enqueue()
    rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if not req.stream:
        r = await server.admission.run(ticket, lambda: work(None, lambda: server.stopping))
        server.metrics.add(r.prompt_tokens, r.completion_tokens, r.kvlite)
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
            r = await server.admission.run(ticket, lambda: None if stop() else work(on_text, stop))
            if r is not None:  # None: the client left before it started
                server.metrics.add(r.prompt_tokens, r.completion_tokens, r.kvlite)
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


# -- llama-server's ---------------------------------------------------------------------------------
@llama.get("/health")
async def health(server: Served):
    if server.model is None:
        raise server.not_ready()
    return {"status": "ok"}


@llama.post("/tokenize")
async def tokenize(request: Request, server: Served):
    ask = parse_tokenize(await body_of(request, server))
    try:
        tokens = server.model.tokenize(ask.content, add_special=ask.add_special, parse_special=ask.parse_special)
    except KvliteError as e:
        raise ApiError(400, str(e)) from None
    if ask.with_pieces:
        return {"tokens": [{"id": t, "piece": server.model.detokenize([t], special=True)} for t in tokens]}
    return {"tokens": tokens}


@llama.post("/detokenize")
async def detokenize(request: Request, server: Served):
    tokens = parse_detokenize(await body_of(request, server), server.model.n_vocab)
    return {"content": server.model.detokenize(tokens, special=True)}  # as llama-server


@llama.get("/slots")
async def slots(server: Served):
    return [s.state() for s in server.slots]


@llama.post("/slots/{slot_id}")
async def slot_action(slot_id: str, request: Request, server: Served, action: str = ""):
    """llama-server's slot files: ?action=save|restore with {"filename": ...}, or ?action=erase."""
    n = parse_slot_action(slot_id, action)
    filename = (await body_of(request, server)).get("filename") if action != "erase" else None
    jobs = {"save": lambda: server.save_slot(n, filename), "restore": lambda: server.restore_slot(n, filename),
            "erase": lambda: server.erase_slot(n)}  # fmt: skip
    return await server.admission.run(server.admission.enqueue(), jobs[action])


@llama.get("/metrics")
async def metrics(server: Served):
    batcher = server.pool.ctx.batcher if server.pool is not None else None
    steps = (batcher.steps, batcher.jobs) if batcher is not None else (0, 0)
    text = server.metrics.prometheus(server.admission.waiting, [s.state() for s in server.slots], steps)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
