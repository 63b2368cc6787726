"""`kvlite serve`: an OpenAI-compatible HTTP server with a per-request eviction policy.

The stack is llama-cpp-python's own server's (FastAPI, uvicorn, sse-starlette), installed by the
`serve` extra. One model, N slots: a slot holds one conversation's compressed cache (its own
llama.cpp context), so a request whose messages extend a slot's conversation prefills only its new
turn, and the policy runs on that turn as `kvlite chat` does. Requests run one at a time on the
model (one worker thread: llama.cpp already uses every core for one batch); the ones that cannot
run yet wait in a bounded queue, and past it get a 503 with Retry-After.

The HTTP layer (create_app) only parses, validates and formats; Server does the work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pathlib
import re
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .api import CHAT_CTX, Conversation, Session, check_evict, check_text, evict_mode
from .cache import Snapshot
from .engine import Model, SamplingParams
from .errors import KvliteError
from .limits import check_int
from .policies import ALL_PARAMS, Policy, make_policy
from .runner import RunSettings

ROLES = ("system", "user", "assistant")
SLOT_FORMAT = 1  # of the files /slots/{id}?action=save writes
SLOT_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_STOP = 4  # OpenAI's limit on stop sequences


@dataclasses.dataclass
class ServeConfig:
    """What `kvlite serve` was started with. policy/params: the default for requests that name
    none (params as make_policy takes them, None = the policy's default)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "full"
    params: dict = dataclasses.field(default_factory=dict)
    settings: RunSettings = dataclasses.field(default_factory=RunSettings)
    evict: str | None = None  # None: per conversation, kvlite.api.evict_mode's default
    n_predict: int = 256  # max_tokens when a request gives none
    max_tokens: int = 4096  # the most a request may ask for
    slots: int = 4
    queue: int = 16  # requests waiting beyond the one running; more get a 503
    api_key: str | None = None
    max_body: int = 8 << 20  # bytes of a request body
    n_gpu_layers: int | None = None
    extra_bufts: bool = False
    model_alias: str | None = None
    slot_save_path: str | None = None  # where /slots/{id}?action=save|restore reads and writes

    def __post_init__(self):
        if self.slots < 1:
            raise KvliteError(f"--slots must be at least 1, got {self.slots}")
        if self.queue < 0:
            raise KvliteError(f"--queue must be 0 or more, got {self.queue}")
        if not 0 < self.port < 65536:
            raise KvliteError(f"--port must be in 1..65535, got {self.port}")
        check_evict(self.evict)
        if self.slot_save_path is not None and not pathlib.Path(self.slot_save_path).is_dir():
            raise KvliteError(f"--slot-save-path {self.slot_save_path} is not a directory")
        check_int("--max-tokens", self.max_tokens)
        check_int("-n", self.n_predict, 0, self.max_tokens)
        if self.api_key is not None and not self.api_key.strip():
            raise KvliteError("--api-key is empty: give a key, or leave the flag out to serve without one")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# -- request validation -------------------------------------------------------------------------


def _field(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # JSON true is not a number here, and an integer is a fine float
    ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _types(kind))
    if not ok and float in _types(kind) and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        names = " or ".join(t.__name__ for t in _types(kind))
        raise ApiError(400, f"'{name}' must be {names}, got {json.dumps(value)[:80]}", param=name)
    return value


def _types(kind: type | tuple) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text is supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", param="messages")
            out.append(part["text"])
        return "".join(out)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts", param="messages")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}]: 'role' must be one of {', '.join(ROLES)}", param="messages")
        out.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    try:  # as kvlite chat and generate refuse it (a NUL in any message: the template's check)
        check_text(out[-1]["content"], "the last user message")
    except KvliteError as e:
        raise ApiError(400, str(e), param="messages") from None
    return out


@dataclasses.dataclass
class Ask:
    """What a completion request asks, validated."""

    policy: Policy
    n_predict: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    conversation_id: str | None = None


def parse_request(body: dict, cfg: ServeConfig, default_sampling: SamplingParams) -> Ask:
    n = _field(body, "max_completion_tokens", int, None)
    n = _field(body, "max_tokens", int, cfg.n_predict) if n is None else n
    if not 0 <= n <= cfg.max_tokens:
        raise ApiError(400, f"'max_tokens' must be in 0..{cfg.max_tokens}, got {n}", param="max_tokens")
    if _field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    temp = _field(body, "temperature", float, default_sampling.temp)
    top_p = _field(body, "top_p", float, default_sampling.top_p)
    top_k = _field(body, "top_k", int, default_sampling.top_k)
    seed = _field(body, "seed", int, default_sampling.seed)
    for name, v in (("temperature", temp), ("top_p", top_p)):
        if not math.isfinite(v):
            raise ApiError(400, f"'{name}' must be a finite number", param=name)
    try:
        sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, seed=seed)
    except KvliteError as e:
        names = {"--temp": "temperature", "--top-p": "top_p", "--top-k": "top_k", "--seed": "seed"}
        message = str(e)
        for flag, field in names.items():
            message = message.replace(flag, field)
        raise ApiError(400, message) from None
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings", param="stop")
    cid = _field(body, "conversation_id", str, None)
    return Ask(
        policy=parse_policy(body, cfg),
        n_predict=n,
        sampling=sampling,
        stop=stop,
        stream=_field(body, "stream", bool, False),
        conversation_id=cid,
    )


def parse_policy(body: dict, cfg: ServeConfig) -> Policy:
    """kv_policy, kv_budget and the policy's parameters under their Python API names; what a
    request leaves out comes from the server's flags (those of another policy do not carry over)."""
    for key in body:
        if key.startswith("kv_") and key not in ("kv_policy", "kv_budget"):
            raise ApiError(400, f"unknown field '{key}': kv_policy, kv_budget, or a policy parameter "
                           f"({', '.join(p for p in ALL_PARAMS if p != 'budget')})", param=key)  # fmt: skip
    if "budget" in body:
        raise ApiError(400, "the budget is 'kv_budget'", param="budget")
    name = _field(body, "kv_policy", str, cfg.policy)
    # the server's flags hold for its own policy; for another, only its budget carries over (not to full)
    carried = {} if name == "full" else {"budget": cfg.params.get("budget")}
    params = dict(cfg.params) if name == cfg.policy else carried
    given = {p: body[p] for p in ALL_PARAMS if p in body and p != "budget"}
    if "kv_budget" in body:
        given["budget"] = _field(body, "kv_budget", int)
    for p, v in given.items():
        if isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
            raise ApiError(400, f"'{p}' cannot be {json.dumps(v)}", param=p)
    try:
        policy = make_policy(name, **{**params, **given})
        if policy.name != "full" and policy.budget is None:
            raise KvliteError(f"kv_policy {name} needs kv_budget (KV cells to keep)")
    except (KvliteError, TypeError, ValueError) as e:
        raise ApiError(400, str(e), param="kv_policy") from None
    return policy


class StopFilter:
    """Streamed text with the stop sequences cut: text that could still begin a stop sequence is
    held back until the next piece decides it."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.hit = stops, "", False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.held = self.held[:cut], ""
            return out
        keep = max((len(s) - 1 for s in self.stops), default=0)
        # hold back only a tail that is a prefix of some stop sequence
        k = next((k for k in range(min(keep, len(self.held)), 0, -1)
                  if any(s.startswith(self.held[-k:]) for s in self.stops)), 0)  # fmt: skip
        out, self.held = self.held[: len(self.held) - k], self.held[len(self.held) - k :]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out

    def around(self, on_text: Callable[[str], None] | None) -> Callable[[str], None]:
        """on_text behind this filter (or just the filter, which still watches for a stop)."""
        return (lambda s: on_text(self.push(s))) if on_text else self.push

    def finish(self, on_text: Callable[[str], None] | None) -> None:
        tail = self.flush()
        if on_text and tail:
            on_text(tail)


# -- the work -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Slot:
    """A conversation's cache. key: the policy it was compressed by (a request under another
    policy cannot continue it)."""

    id: int
    conversation: Conversation | None = None
    key: str = ""
    conversation_id: str | None = None
    last_used: float = 0.0
    requests: int = 0

    @property
    def messages(self) -> list[dict]:
        return self.conversation.messages if self.conversation else []


@dataclasses.dataclass
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    kvlite: dict


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors = 0
        self.rejected = 0
        self.prompt_tokens = self.prefilled_tokens = self.completion_tokens = 0
        self.prefill_s = self.decode_s = 0.0

    def count(self, endpoint: str) -> None:
        with self.lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def add(self, r: Result) -> None:
        t = r.kvlite["timings"]
        with self.lock:
            self.prompt_tokens += r.prompt_tokens
            self.prefilled_tokens += r.kvlite["prefilled_tokens"]
            self.completion_tokens += r.completion_tokens
            self.prefill_s += t["prefill_s"]
            self.decode_s += t["decode_s"]


class Server:
    """The model, the slots and the queue; every model call runs on the one worker thread."""

    def __init__(self, cfg: ServeConfig, model: Model | None = None):
        self.cfg = cfg
        self.model = model
        self.load_error: str | None = None
        self.slots = [Slot(i) for i in range(cfg.slots)]
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlite-model")
        self.active = 0  # requests admitted and not finished: one running, the rest waiting
        self.stopping = False  # set by close(): every job's `cancelled` turns True
        self._lock = threading.Lock()
        self.metrics = Metrics()
        self.started = time.time()
        self.default_sampling = cfg.settings.sampling

    @property
    def model_id(self) -> str:
        if self.cfg.model_alias:
            return self.cfg.model_alias
        return self.model.path.name if self.model else (self.cfg.model or "default")

    def load(self) -> None:
        from .models import resolve_model

        try:
            self.model = Model(resolve_model(self.cfg.model), use_extra_bufts=self.cfg.extra_bufts,
                               n_gpu_layers=self.cfg.n_gpu_layers)  # fmt: skip
        except KvliteError as e:
            self.load_error = str(e)
        except Exception as e:  # noqa: BLE001 - whatever it was, the server must end, not wait at 503
            self.load_error = f"the model could not be loaded ({type(e).__name__}: {e})"

    def enqueue(self) -> dict:
        """Admit a request (one running, cfg.queue waiting), or answer 503 (before a stream starts)."""
        with self._lock:
            if self.active > self.cfg.queue:
                self.metrics.rejected += 1
                raise ApiError(503, "the server is busy: try again shortly", kind="unavailable_error")
            self.active += 1
        return {"settled": False}

    def _settle(self, ticket: dict) -> bool:
        """True the first time: when its job starts, or when its request went away before that."""
        with self._lock:
            if ticket["settled"]:
                return False
            ticket["settled"] = True
            return True

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    async def run(self, ticket: dict, job: Callable[[], Any]) -> Any:
        """job on the worker thread, after the requests admitted before it."""

        def start():
            if not self._settle(ticket):
                return None  # its request was cancelled while it waited
            try:
                return job()
            finally:
                self._leave()

        try:
            return await asyncio.get_running_loop().run_in_executor(self.worker, start)
        finally:
            if self._settle(ticket):  # never started: it leaves now
                self._leave()

    # -- chat ---------------------------------------------------------------------------------
    def pick_slot(self, messages: list[dict], req: Ask) -> tuple[Slot, list[dict]]:
        """The slot whose conversation the messages extend (longest match), else the free or
        least recently used one, reset. Returns it and the messages it has not read."""
        key = _key(req.policy, evict_mode(self.cfg.evict, req.policy))
        if req.conversation_id is not None:
            slot = next((s for s in self.slots if s.conversation_id == req.conversation_id), None)
            candidates = [slot] if slot else []
        else:
            candidates = self.slots

        def extends(s: Slot) -> bool:
            held = s.messages
            return s.key == key and 0 < len(held) < len(messages) and messages[: len(held)] == held

        matches = [s for s in candidates if extends(s)]
        if matches:
            best = max(matches, key=lambda s: len(s.messages))
            return best, messages[len(best.messages) :]
        if req.conversation_id is not None and candidates:
            slot = candidates[0]  # its conversation, started over
        else:
            slot = min(self.slots, key=lambda s: (s.conversation is not None, s.last_used))  # free, else LRU
        self._reset(slot, req, key)
        return slot, messages

    def _reset(self, slot: Slot, req: Ask, key: str) -> None:
        if slot.conversation is not None and slot.key == key:
            slot.conversation.reset()
        else:
            if slot.conversation is not None:
                slot.conversation.runner.close()
            session = Session(self.model, req.policy, self.cfg.settings)
            slot.conversation = session.conversation(evict=self.cfg.evict)
            slot.key = key
        slot.conversation_id = req.conversation_id

    def chat(self, messages: list[dict], req: Ask, on_text: Callable[[str], None] | None,
             cancelled: Callable[[], bool]) -> Result:  # fmt: skip
        if self.model.chat_template is None:
            raise ApiError(400, f"{self.model.path.name} has no chat template: use /v1/completions")
        try:
            slot, new = self.pick_slot(messages, req)  # a policy the chat modes cannot run is refused here
        except KvliteError as e:
            raise ApiError(400, str(e)) from None
        conv = slot.conversation
        runner, cache = conv.runner, conv.runner.cache
        runner.use_sampling(req.sampling)
        before = _counters(runner)
        slot_peak, cache.max_cells = cache.max_cells, cache.n_resident  # this request's peak, then the slot's
        stops = StopFilter(req.stop)
        try:
            reply, stopped = conv.turn(new, req.n_predict, stops.around(on_text), lambda: cancelled() or stops.hit,
                                       progress=False)  # fmt: skip
        except KvliteError as e:
            raise ApiError(400, str(e)) from None
        finally:
            slot.last_used, slot.requests = time.time(), slot.requests + 1
            peak = cache.max_cells
            cache.max_cells = max(slot_peak, peak)
        stops.finish(on_text)
        text = _cut(reply, req.stop)
        if stops.hit:
            stopped = "stop"
            conv.messages[-1]["content"] = text  # as the client will send it back
        generated = runner.timings.decode_tokens - before["decode_tokens"]
        prompt_tokens = cache.n_pos - generated  # every reply token is decoded into the cache
        return Result(
            text=text,
            finish_reason=_finish(stopped),
            prompt_tokens=prompt_tokens,
            completion_tokens=generated,
            kvlite={**self._report(slot, runner, before, prompt_tokens), "peak_cells": peak},
        )

    # -- completions ----------------------------------------------------------------------------
    def complete(self, prompt: str, req: Ask, on_text: Callable[[str], None] | None,
                 cancelled: Callable[[], bool]) -> Result:  # fmt: skip
        """A prompt on a fresh cache (no slot: completions carry no conversation). Its context is
        bounded as a slot's is (-c, else 4096 cells; chunked mode: budget + chunk), not sized to
        whatever prompt arrives."""
        n_ctx = self.cfg.settings.n_ctx or (0 if req.policy.continuous else CHAT_CTX)
        settings = dataclasses.replace(self.cfg.settings, sampling=req.sampling, n_ctx=n_ctx)
        stops = StopFilter(req.stop)
        try:
            session = Session(self.model, req.policy, settings)
            g = session.generate(prompt, req.n_predict, on_text=stops.around(on_text),
                                 interrupted=lambda: cancelled() or stops.hit)  # fmt: skip
        except KvliteError as e:
            raise ApiError(400, str(e)) from None
        stops.finish(on_text)
        t = g.timings
        info = {
            "policy": repr(req.policy),
            "budget": g.cache["budget"],
            "kept_cells": g.cache["final_cells"],
            "evicted_cells": g.cache["evicted"],
            "max_cells": g.cache["max_cells"],
            "peak_cells": g.cache["max_cells"],
            "workspace_forward_passes": g.cache["workspace_forward_passes"],
            "prefilled_tokens": g.prompt_tokens,
            "reused_tokens": 0,
            "timings": t,
        }
        return Result(_cut(g.text, req.stop), "stop" if stops.hit else _finish(g.stopped), g.prompt_tokens,
                      g.generated_tokens, info)  # fmt: skip

    def _report(self, slot: Slot, runner, before: dict, prompt_tokens: int) -> dict:
        after = _counters(runner)
        t = {k: after[k] - before[k] for k in ("prefill_s", "decode_s", "evict_s", "prefill_tokens", "decode_tokens")}
        t["prefill_tok_s"] = t["prefill_tokens"] / t["prefill_s"] if t["prefill_s"] else None
        t["decode_tok_s"] = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else None
        cache = runner.cache
        return {
            "slot": slot.id,
            "conversation_id": slot.conversation_id,
            "policy": repr(runner.policy),
            "evict": slot.conversation.evict,
            "budget": runner.policy.budget,
            "cap": slot.conversation.cap,
            "kept_cells": cache.n_resident,
            "evicted_cells": after["evicted"] - before["evicted"],
            "max_cells": cache.max_cells,
            "workspace_forward_passes": after["workspace_forward_passes"] - before["workspace_forward_passes"],
            "prefilled_tokens": t["prefill_tokens"],
            "reused_tokens": prompt_tokens - t["prefill_tokens"],  # read from the slot's cache, not prefilled
            "timings": t,
        }

    # -- slot files -----------------------------------------------------------------------------
    def _slot_file(self, filename: Any) -> pathlib.Path:
        if self.cfg.slot_save_path is None:
            raise ApiError(400, "slot files are off: start the server with --slot-save-path DIR")
        if not isinstance(filename, str) or not SLOT_FILE.fullmatch(filename):
            raise ApiError(400, "'filename' must be a plain file name (letters, digits, '.', '_', '-')",
                           param="filename")  # fmt: skip
        return pathlib.Path(self.cfg.slot_save_path) / filename

    def slot(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < len(self.slots):
            raise ApiError(400, f"no slot {slot_id}: the slots are 0..{len(self.slots) - 1}")
        return self.slots[slot_id]

    def save_slot(self, slot_id: int, filename: Any) -> dict:
        """The slot's conversation to a file: llama.cpp's state blob of its sequence and what kvlite
        knows beside it (which positions are resident, the messages, the policy)."""
        slot, path = self.slot(slot_id), self._slot_file(filename)
        conv = slot.conversation
        if conv is None or not conv.messages:
            raise ApiError(400, f"slot {slot_id} holds no conversation")
        t0 = time.perf_counter()
        snap = conv.runner.cache.snapshot()
        policy = conv.runner.policy
        meta = {"format": SLOT_FORMAT, "model": self.model.path.name, "model_bytes": self.model.path.stat().st_size,
                "policy": policy.name, "params": policy_params(policy), "evict": conv.evict,
                "messages": conv.messages, "rendered": conv.rendered, "conversation_id": slot.conversation_id,
                "evicted": conv.runner.cache.evicted, "cache": _cache_layout(conv.runner.ctx)}  # fmt: skip
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8), "live": snap.live,
                  "tokens": np.asarray(snap.tokens, np.int32), "blob": np.frombuffer(snap.blob, np.uint8)}  # fmt: skip
        if snap.hidden is not None:
            arrays["hidden"] = snap.hidden
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with open(tmp, "wb") as f:  # written whole, then renamed: a full disk leaves no half file
                np.savez(f, **arrays)
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ApiError(500, f"cannot write {path}: {e.strerror or e}", kind="server_error") from None
        ms = (time.perf_counter() - t0) * 1000
        return {"id_slot": slot_id, "filename": path.name, "n_saved": len(snap.tokens),
                "n_written": path.stat().st_size, "timings": {"save_ms": ms}}  # fmt: skip

    def restore_slot(self, slot_id: int, filename: Any) -> dict:
        slot, path = self.slot(slot_id), self._slot_file(filename)
        t0 = time.perf_counter()
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]))
                arrays = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise ApiError(400, f"no slot file {path.name} in {self.cfg.slot_save_path}") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            raise ApiError(400, f"{path.name} is not a kvlite slot file ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != SLOT_FORMAT:
            raise ApiError(400, f"{path.name} is not a kvlite slot file of format {SLOT_FORMAT}")
        _check_slot_meta(path.name, meta)
        if (meta["model"], meta["model_bytes"]) != (self.model.path.name, self.model.path.stat().st_size):
            raise ApiError(400, f"{path.name} was saved from {meta['model']}, not {self.model.path.name}")
        try:
            policy = make_policy(meta["policy"], **meta["params"])
            session = Session(self.model, policy, self.cfg.settings)
            conv = session.conversation(evict=meta["evict"])
            saved, here = meta.get("cache", _F16_LAYOUT), _cache_layout(conv.runner.ctx)
            if saved != here:  # llama.cpp would load a rotated cache into an unrotated one without a word
                conv.runner.close()
                raise ApiError(400, f"{path.name} holds a {_describe(saved)} cache; this server's is {_describe(here)}")
            hidden_layer = conv.runner.cache.hidden_layer
            snap = Snapshot(arrays["blob"].tobytes(), tuple(int(t) for t in arrays["tokens"]), arrays["live"],
                            arrays.get("hidden"), hidden_layer if "hidden" in arrays else None)  # fmt: skip
            conv.runner.restore(snap)
        except (KvliteError, KeyError, TypeError, ValueError) as e:
            raise ApiError(400, f"{path.name} cannot be restored: {e}") from None
        conv.messages, conv.rendered = meta["messages"], meta["rendered"]
        conv.runner.cache.evicted = meta["evicted"]
        if slot.conversation is not None:
            slot.conversation.runner.close()
        slot.conversation, slot.key = conv, _key(policy, conv.evict)
        slot.conversation_id, slot.last_used = meta["conversation_id"], time.time()
        ms = (time.perf_counter() - t0) * 1000
        return {"id_slot": slot_id, "filename": path.name, "n_restored": len(snap.tokens),
                "n_read": path.stat().st_size, "timings": {"restore_ms": ms}}  # fmt: skip

    def erase_slot(self, slot_id: int) -> dict:
        slot = self.slot(slot_id)
        n = slot.conversation.runner.cache.n_pos if slot.conversation else 0
        if slot.conversation is not None:
            slot.conversation.reset()
        slot.conversation_id = None
        return {"id_slot": slot_id, "n_erased": n}

    def close(self) -> None:
        """Stop: the running generation ends at its next token (a shutdown does not wait out a
        long reply), the queued ones never start, the slots' contexts are freed."""
        self.stopping = True
        self.worker.shutdown(wait=True, cancel_futures=True)
        for s in self.slots:
            if s.conversation is not None:
                s.conversation.runner.close()
                s.conversation = None


# what a slot file's metadata holds: a field of another type is a file not written by kvlite
SLOT_META = {"model": str, "model_bytes": int, "policy": str, "params": dict, "evict": str, "messages": list,
             "rendered": str, "conversation_id": (str, type(None)), "evicted": int}  # fmt: skip


def _check_slot_meta(name: str, meta: dict) -> None:
    for key, kind in SLOT_META.items():
        value = meta.get(key)
        if key not in meta or not isinstance(value, kind) or isinstance(value, bool):
            raise ApiError(400, f"{name} is not a kvlite slot file: its '{key}' is missing or malformed")
    if meta["evicted"] < 0 or meta["model_bytes"] < 0:
        raise ApiError(400, f"{name} is not a kvlite slot file: a negative count")
    for m in meta["messages"]:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ApiError(400, f"{name} is not a kvlite slot file: a message is not a role and a text")


_F16_LAYOUT = {"type_k": "f16", "type_v": "f16", "rotations": [0, 0]}  # slot files from before cache types


def _cache_layout(ctx) -> dict:
    """What a state blob's bytes mean: the cache types and llama.cpp's rotation of them."""
    return {"type_k": ctx.type_k, "type_v": ctx.type_v, "rotations": list(ctx.rotations)}


def _describe(layout) -> str:
    if not isinstance(layout, dict):
        return "unknown"
    rot = "rotated" if any(layout.get("rotations", [])) else "unrotated"
    return f"-ctk {layout.get('type_k')} -ctv {layout.get('type_v')} ({rot})"


def _key(policy: Policy, evict: str) -> str:
    """Which requests may continue a slot's conversation: those under the same policy and mode."""
    return f"{policy!r} {evict}"


def policy_params(policy: Policy) -> dict:
    """The policy's declared parameters, as make_policy takes them."""
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name in ALL_PARAMS}


def _counters(runner) -> dict:
    t = runner.timings
    return dict(prefill_s=t.prefill_s, decode_s=t.decode_s, evict_s=t.evict_s, prefill_tokens=t.prefill_tokens,
                decode_tokens=t.decode_tokens, evicted=runner.cache.evicted,
                workspace_forward_passes=runner.workspace_forward_passes)  # fmt: skip


def _cut(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _finish(stopped: str) -> str:
    return {"eog": "stop", "stop": "stop", "length": "length", "context full": "length"}.get(stopped, "stop")
