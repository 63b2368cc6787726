"""`kvlite serve`: an OpenAI-compatible HTTP server with a per-request eviction policy.

The stack is llama-cpp-python's own server's (FastAPI, uvicorn, sse-starlette), installed by the
`serve` extra. One model, N slots: a slot holds one conversation's compressed cache (its own
llama.cpp context, or a lane of one pool with --kv-cells), so a request whose messages extend a
slot's conversation prefills only its new turn, and the policy runs on that turn as `kvlite chat`
does. One job a module:

    config.py     ServeConfig: what the server was started with
    requests.py   every endpoint's request parsed and checked (ApiError in OpenAI's shape)
    admission.py  the requests on the model at once (one, or a slot's each in a pool), a bounded queue, 503 past it
    slots.py      which slot a conversation continues, LRU, and the slot-file codec
    server.py     Server: the work of each endpoint and the report each answer carries
    metrics.py    the counters and /metrics
    routes.py     the FastAPI routers; app.py: the app, its guard, uvicorn (these two need the extra)
"""

from .config import ServeConfig
from .requests import ApiError, Ask, parse_messages, parse_policy, parse_request
from .server import Result, Server, StopFilter

__all__ = ["ApiError", "Ask", "Result", "ServeConfig", "Server", "StopFilter", "parse_messages", "parse_policy",
           "parse_request"]  # fmt: skip
