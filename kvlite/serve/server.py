"""The work behind the endpoints: a chat turn on the slot its messages continue, a completion on a
fresh cache, the slot files, and the report each answer carries. Every model call runs on one of
the admission's worker threads; with a pool, several turns run at once, each holding its slot and
the cells its turn may take (room.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import slotfile
from ..api import Conversation, Session
from ..engine import Model, Pool
from ..errors import KvliteError
from ..evict import chat_ctx, evict_mode
from ..settings import RunSettings, plan_context
from .admission import Admission
from .config import ServeConfig
from .metrics import Metrics
from .requests import ApiError, Ask, parse_filename
from .room import Room
from .slots import Slot, Slots, slot_key


def first_stop(text: str, stops: list[str]) -> int:
    """Where the first stop sequence begins in text (-1: none does)."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


class StopFilter:
    """Streamed text with the stop sequences cut: text that could still begin a stop sequence is
    held back until the next piece decides it."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.hit = stops, "", False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        self.held += text
        cut = first_stop(self.held, self.stops)
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

    def cut(self, text: str) -> str:
        """The whole text as the client is given it."""
        i = first_stop(text, self.stops)
        return text if i < 0 else text[:i]


@dataclasses.dataclass
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    kvlite: dict


def report(policy: str, cache: dict, timings: dict, n_prompt: int, prefilled: int, peak: int, **extra) -> dict:
    """The `kvlite` object of an answer, from a run's cache report and timings (Runner.cache_report
    and Timings.as_dict: a generation's, or one request's of a conversation)."""
    return {
        **extra,
        "policy": policy,
        "budget": cache["budget"],
        "kept_cells": cache["final_cells"],
        "evicted_cells": cache["evicted"],
        "max_cells": cache["max_cells"],
        "peak_cells": peak,
        "workspace_forward_passes": cache["workspace_forward_passes"],
        "prefilled_tokens": prefilled,
        "reused_tokens": n_prompt - prefilled,  # read from the slot's cache, not prefilled
        "timings": timings,
    }


def finish_reason(stopped: str) -> str:
    return {"eog": "stop", "stop": "stop", "length": "length", "context full": "length"}.get(stopped, "stop")


class Server:
    """The model, the slots and the admission; what each endpoint does once its request is parsed."""

    def __init__(self, cfg: ServeConfig, model: Model | None = None):
        self.cfg = cfg
        self.model = model
        self.load_error: str | None = None
        self.metrics = Metrics()
        # A pool's turns run at once, one a slot (their decodes batched); without one, one at a time
        self.admission = Admission(cfg.queue, self.metrics.reject, cfg.slots if cfg.kv_cells else 1)
        self.slot_table = Slots(cfg.slots)
        self.room = Room(self.slot_table, self.metrics)
        self.pool = self.room.pool = self._make_pool() if model is not None else None  # loaded: load()
        self.stopping = False  # set by close(): every job's `cancelled` turns True
        self.started = time.time()
        self.default_sampling = cfg.settings.sampling

    @property
    def slots(self) -> list[Slot]:
        return self.slot_table.all

    @property
    def reserved(self) -> dict[object, int]:
        """The pool's cells each running turn may hold at most, by slot id (or a completion's key)."""
        return self.room.reserved

    @property
    def active(self) -> int:
        """Requests admitted and not finished: one running, the rest waiting."""
        return self.admission.active

    @property
    def model_id(self) -> str:
        if self.cfg.model_alias:
            return self.cfg.model_alias
        return self.model.path.name if self.model else (self.cfg.model or "default")

    def load(self) -> None:
        from ..models import resolve_model

        try:
            self.model = Model(resolve_model(self.cfg.model), use_extra_bufts=self.cfg.extra_bufts,
                               n_gpu_layers=self.cfg.n_gpu_layers)  # fmt: skip
            self.pool = self.room.pool = self._make_pool()
        except KvliteError as e:
            self.load_error = str(e)
        except Exception as e:  # noqa: BLE001 - whatever it was, the server must end, not wait at 503
            self.load_error = f"the model could not be loaded ({type(e).__name__}: {e})"

    def _make_pool(self) -> Pool | None:
        """--kv-cells: the one context every slot's conversation shares (0: none). Two lanes a slot: one
        for its conversation, one for what its worker may run beside (a completion, or a slot file's
        conversation, made before the one it replaces is let go)."""
        if not self.cfg.kv_cells:
            return None
        s = self.cfg.settings
        return Pool(self.model, self.cfg.kv_cells, 2 * self.cfg.slots, n_batch=s.chunk, n_threads=s.n_threads,
                    flash_attn=s.flash_attn, type_k=s.type_k, type_v=s.type_v)  # fmt: skip

    def not_ready(self) -> ApiError:
        """The answer while there is no model: loading (503), or it could not be loaded (500)."""
        if self.load_error:
            return ApiError(500, f"the model could not be loaded: {self.load_error}", kind="server_error")
        return ApiError(503, "Loading model", kind="unavailable_error")

    def _conversation(self, policy, evict: str | None, recall: int = 0) -> Conversation:
        conv = Session(self.model, policy, self.cfg.settings, pool=self.pool).conversation(evict=evict, recall=recall)
        if self.pool is not None and conv.cap + policy.lookahead_cells() > self.pool.ctx.n_ctx:
            conv.runner.close()
            raise KvliteError(f"a conversation's cap of {conv.cap} cells (-c) does not fit in --kv-cells "
                              f"{self.pool.ctx.n_ctx}: raise --kv-cells or lower -c")  # fmt: skip
        return conv

    @contextlib.contextmanager
    def _turn_slot(self, messages: list[dict], req: Ask) -> Iterator[tuple[Slot, list[dict]]]:
        """The slot whose conversation the messages continue (else a free or the least recently used
        one) and the messages it has not read, held for this request with room for its turn."""
        with self.room.lock:
            while self.slot_table.busy_with(req.conversation_id):  # the same conversation's last request
                self.room.lock.wait()
            try:  # a policy the chat modes cannot run is refused here
                key = slot_key(req.policy, evict_mode(self.cfg.evict, req.policy), req.recall)
                make = lambda: self._conversation(req.policy, self.cfg.evict, req.recall)  # noqa: E731
                slot, new = self.slot_table.pick(messages, key, req.conversation_id, make)
            except KvliteError as e:
                raise ApiError(400, str(e)) from None
            slot.conversation.runner.recall_cells = req.recall  # how many come back is this request's
            slot.busy = True
            try:
                if self.pool is not None:
                    need = self.room.need(slot, slot.conversation.pending_tokens(new), req.n_predict)
                    self.room.admit(need, slot)
                    self.room.reserved[slot.id] = need
            except KvliteError as e:
                self.room.let_go(slot)
                raise ApiError(400, str(e)) from None
            except BaseException:
                self.room.let_go(slot)
                raise
        try:
            yield slot, new
        finally:
            with self.room.lock:
                self.room.let_go(slot)

    # -- chat -------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], req: Ask, on_text: Callable[[str], None] | None,
             cancelled: Callable[[], bool]) -> Result:  # fmt: skip
        if self.model.chat_template is None:
            raise ApiError(400, f"{self.model.path.name} has no chat template: use /v1/completions")
        with self._turn_slot(messages, req) as (slot, new):
            return self._chat_turn(slot, new, req, on_text, cancelled)

    def _chat_turn(self, slot: Slot, new: list[dict], req: Ask, on_text: Callable[[str], None] | None,
                   cancelled: Callable[[], bool]) -> Result:  # fmt: skip
        conv = slot.conversation
        runner = conv.runner
        runner.use_sampling(req.sampling)
        before = runner.mark()
        stops = StopFilter(req.stop)
        first_come = self.pool.ctx.batcher.turn(runner.cache.lane) if self.pool else contextlib.nullcontext()
        with runner.cache.peak_within() as peak, first_come:  # this request's peak; max_cells stays the slot's
            try:
                reply, stopped = conv.turn(new, req.n_predict, stops.around(on_text),
                                           lambda: cancelled() or stops.hit, progress=False)  # fmt: skip
            except KvliteError as e:
                raise ApiError(400, str(e)) from None
            finally:
                self.slot_table.used(slot)
        stops.finish(on_text)
        text = stops.cut(reply)
        if stops.hit:
            stopped = "stop"
            conv.amend_reply(text)
        t = runner.timings_since(before)
        generated = t["decode_tokens"]
        prompt_tokens = runner.cache.n_pos - generated  # every reply token is decoded into the cache
        info = report(repr(runner.policy), runner.cache_report(0, before), t, prompt_tokens, t["prefill_tokens"],
                      peak[0], slot=slot.id, conversation_id=slot.conversation_id, evict=conv.evict,
                      cap=conv.cap, recall=runner.recall_cells, stored_cells=len(runner.cache.stored))  # fmt: skip
        return Result(text, finish_reason(stopped), prompt_tokens, generated, info)

    # -- completions ------------------------------------------------------------------------------
    def for_prompt(self, given: str | list[dict], req: Ask) -> Ask:
        """A request whose kv_budget is a share of the prompt, with the policy's budget in cells of
        this prompt (as Session.generate reads it). A conversation's turns are not one prompt."""
        try:
            if not isinstance(given, str):
                req.policy.require_cells("/v1/chat/completions", "kv_budget")
            n_tokens = len(self.model.tokenize(given, add_special=True, parse_special=False))
            return dataclasses.replace(req, policy=req.policy.resolve(n_tokens), budget_share=req.policy.budget)
        except KvliteError as e:
            raise ApiError(400, str(e), param="kv_budget") from None

    def complete(self, prompt: str, req: Ask, on_text: Callable[[str], None] | None,
                 cancelled: Callable[[], bool]) -> Result:  # fmt: skip
        """A prompt on a fresh cache (no slot: completions carry no conversation). Its context is
        bounded as a slot's is (-c, else a chat's; chunked mode: budget + chunk), not sized to
        whatever prompt arrives."""
        settings = dataclasses.replace(self.cfg.settings, sampling=req.sampling,
                                       n_ctx=chat_ctx(self.cfg.settings.n_ctx, req.policy))  # fmt: skip
        stops = StopFilter(req.stop)
        with self._completion_room(prompt, req, settings):
            try:
                session = Session(self.model, req.policy, settings, pool=self.pool)
                g = session.generate(prompt, req.n_predict, on_text=stops.around(on_text),
                                     interrupted=lambda: cancelled() or stops.hit)  # fmt: skip
            except KvliteError as e:
                raise ApiError(400, str(e)) from None
        stops.finish(on_text)
        share = {"budget_share": req.budget_share} if req.budget_share else {}
        info = report(repr(req.policy), g.cache, g.timings, g.prompt_tokens, g.prompt_tokens, g.cache["max_cells"],
                      **share)  # fmt: skip
        return Result(stops.cut(g.text), "stop" if stops.hit else finish_reason(g.stopped), g.prompt_tokens,
                      g.generated_tokens, info)  # fmt: skip

    @contextlib.contextmanager
    def _completion_room(self, prompt: str, req: Ask, settings: RunSettings) -> Iterator[None]:
        """In a pool, the cells a completion may hold (its prompt, its reply and a lookahead's, up to
        the context planned for it) reserved for it while it runs, on a lane of its own."""
        if self.pool is None:
            yield
            return
        try:
            n_tokens = len(self.model.tokenize(prompt, add_special=True, parse_special=False))
            n_ctx, _ = plan_context(req.policy, settings.n_ctx, n_tokens, req.n_predict, settings.chunk)
        except KvliteError as e:
            raise ApiError(400, str(e)) from None
        if n_ctx > self.pool.ctx.n_ctx:
            raise ApiError(400, f"a completion's context of {n_ctx} cells (-c) does not fit in --kv-cells "
                           f"{self.pool.ctx.n_ctx}: raise --kv-cells or lower -c")  # fmt: skip
        with self.room.apart(min(n_ctx, n_tokens + req.n_predict + req.policy.lookahead_cells())):
            yield

    # -- slot files -------------------------------------------------------------------------------
    def _slot(self, slot_id: int) -> Slot:
        try:
            return self.slot_table[slot_id]
        except KvliteError as e:
            raise ApiError(400, str(e)) from None

    def _slot_file(self, filename: Any) -> pathlib.Path:
        if self.cfg.slot_save_path is None:
            raise ApiError(400, "slot files are off: start the server with --slot-save-path DIR")
        return pathlib.Path(self.cfg.slot_save_path) / parse_filename(filename)

    def save_slot(self, slot_id: int, filename: Any) -> dict:
        """The slot's conversation to a file: llama.cpp's state blob of its sequence and what kvlite
        knows beside it (which positions are resident, the messages, the policy)."""
        slot, path = self._slot(slot_id), self._slot_file(filename)
        with self.room.hold(slot):
            if slot.conversation is None or not slot.conversation.messages:
                raise ApiError(400, f"slot {slot_id} holds no conversation")
            t0 = time.perf_counter()
            try:
                n = slotfile.write_slot_file(path, slot.conversation, self.model, slot.parked, slot.conversation_id)
            except KvliteError as e:
                raise ApiError(500, str(e), kind="server_error") from None
            ms = (time.perf_counter() - t0) * 1000
        return {"id_slot": slot_id, "filename": path.name, "n_saved": n, "n_written": path.stat().st_size,
                "timings": {"save_ms": ms}}  # fmt: skip

    def restore_slot(self, slot_id: int, filename: Any) -> dict:
        slot, path = self._slot(slot_id), self._slot_file(filename)
        t0 = time.perf_counter()
        try:
            saved = slotfile.read_slot_file(path, self.cfg.slot_save_path, self.model.path)
        except KvliteError as e:
            raise ApiError(400, str(e)) from None
        meta = saved.meta
        with self.room.hold(slot):
            conv = None
            try:
                policy = saved.policy()
                with self.room.lock:
                    conv = self._conversation(policy, meta["evict"], saved.recall)
                saved.check_layout(conv, path.name)
                snap = saved.snapshot(conv.runner.cache.hidden_layer)
                if self.pool is not None:  # its cells, beside the conversation it replaces, others parked
                    with self.room.lock:
                        self.room.admit(snap.cells, None)
                        self.room.reserved[slot.id] += snap.cells
                saved.restore(conv, snap)
            except BaseException as e:
                if conv is not None:
                    with self.room.lock:
                        conv.runner.close()
                if isinstance(e, (KvliteError, KeyError, TypeError, ValueError)):
                    raise ApiError(400, f"{path.name} cannot be restored: {e}") from None
                raise
            with self.room.lock:
                slot.hold(conv, slot_key(policy, conv.evict, saved.recall), meta["conversation_id"])
            slot.last_used = time.time()
        ms = (time.perf_counter() - t0) * 1000
        return {"id_slot": slot_id, "filename": path.name, "n_restored": len(snap.tokens),
                "n_read": path.stat().st_size, "timings": {"restore_ms": ms}}  # fmt: skip

    def erase_slot(self, slot_id: int) -> dict:
        slot = self._slot(slot_id)
        with self.room.hold(slot):
            n = slot.conversation.runner.cache.n_pos if slot.conversation else 0
            if slot.parked:
                n = len(slot.parked[0].tokens)
            slot.start_over(None)
        return {"id_slot": slot_id, "n_erased": n}

    def close(self) -> None:
        """Stop: the running generation ends at its next token (a shutdown does not wait out a
        long reply), the queued ones never start, the slots' contexts are freed."""
        self.stopping = True
        self.admission.close()
        self.slot_table.close()
        if self.pool is not None:
            self.pool.close()
