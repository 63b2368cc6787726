"""The server's slots: which one a request's messages continue, the least recently used one to
give up, and the slot-file codec (llama.cpp's state blob of a conversation's sequence, as a
cache.Snapshot, and what kvlite knows beside it)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import zipfile
from collections.abc import Callable

import numpy as np

from ..api import Conversation
from ..cache import Snapshot
from ..engine import Model
from ..policies import ALL_PARAMS, Policy
from .requests import ROLES, ApiError

SLOT_FORMAT = 1  # of the files /slots/{id}?action=save writes


@dataclasses.dataclass
class Slot:
    """A conversation's cache. key: the policy and mode it was compressed by (a request under
    another cannot continue it)."""

    id: int
    conversation: Conversation | None = None
    key: str = ""
    conversation_id: str | None = None
    last_used: float = 0.0
    requests: int = 0
    # In a pool (--kv-cells): the conversation's cache set aside in host memory to give its cells to
    # another, and how many positions it had evicted; restored when the slot is next used.
    parked: tuple[Snapshot, int] | None = None
    busy: bool = False  # a request has it (Server.room)

    @property
    def resident(self) -> int:
        """Cells the slot holds in the context (none while parked)."""
        return self.conversation.runner.cache.n_cells if self.conversation and not self.parked else 0

    def park(self) -> None:
        cache = self.conversation.runner.cache
        self.parked = (cache.snapshot(), cache.evicted)
        cache.reset()

    def unpark(self) -> None:
        """The parked cache back in the context, as it was (the runner's observed queries too)."""
        snap, evicted = self.parked
        self.conversation.runner.cache.restore(snap, evicted)
        self.parked = None

    @property
    def messages(self) -> list[dict]:
        return self.conversation.messages if self.conversation else []

    def state(self) -> dict:
        """What GET /slots shows of it."""
        conv = self.conversation
        cache = conv.runner.cache if conv else None
        return {
            "id": self.id,
            "is_processing": self.busy,
            "parked": self.parked is not None,
            "conversation_id": self.conversation_id,
            "policy": repr(conv.runner.policy) if conv else None,
            "budget": conv.runner.policy.budget if conv else None,
            "messages": len(self.messages),
            "n_pos": cache.n_pos if cache else 0,
            "resident_cells": self.resident,
            "evicted_cells": cache.evicted if cache else 0,
            "requests": self.requests,
            "last_used": self.last_used or None,
        }

    def hold(self, conversation: Conversation, key: str, conversation_id: str | None) -> None:
        """Take a new conversation, freeing the context (or the pool lane) of the one it held."""
        if self.conversation is not None and self.conversation is not conversation:
            self.conversation.runner.close()
        self.conversation, self.key, self.conversation_id = conversation, key, conversation_id
        self.parked = None

    def start_over(self, conversation_id: str | None) -> None:
        """Keep the conversation (its context or lane), forget what it said and held."""
        self.parked = None
        if self.conversation is not None:
            self.conversation.reset()
        self.conversation_id = conversation_id

    def close(self) -> None:
        if self.conversation is not None:
            self.conversation.runner.close()
            self.conversation = None
        self.parked = None


def slot_key(policy: Policy, evict: str) -> str:
    """Which requests may continue a slot's conversation: those under the same policy and mode."""
    return f"{policy!r} {evict}"


class Slots:
    """N slots, each holding at most one conversation's compressed cache."""

    def __init__(self, n: int):
        self.all = [Slot(i) for i in range(n)]

    def __getitem__(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < len(self.all):
            raise ApiError(400, f"no slot {slot_id}: the slots are 0..{len(self.all) - 1}")
        return self.all[slot_id]

    def busy_with(self, conversation_id: str | None) -> bool:
        """Whether a request holds the slot of this conversation (None: none named)."""
        return conversation_id is not None and any(s.busy and s.conversation_id == conversation_id for s in self.all)

    def pick(self, messages: list[dict], key: str, conversation_id: str | None,
             start: Callable[[], Conversation]) -> tuple[Slot, list[dict]]:  # fmt: skip
        """The slot whose conversation the messages extend (longest match), else the free or least
        recently used one, started over (start: a new conversation under the request's policy).
        Slots another request holds are not candidates (there is always one free: a request at
        most holds one). Returns it and the messages it has not read."""
        idle = [s for s in self.all if not s.busy]
        if conversation_id is not None:
            slot = next((s for s in idle if s.conversation_id == conversation_id), None)
            candidates = [slot] if slot else []
        else:
            candidates = idle

        def extends(s: Slot) -> bool:
            held = s.messages
            return s.key == key and 0 < len(held) < len(messages) and messages[: len(held)] == held

        matches = [s for s in candidates if extends(s)]
        if matches:
            best = max(matches, key=lambda s: len(s.messages))
            return best, messages[len(best.messages) :]
        if conversation_id is not None and candidates:
            slot = candidates[0]  # its conversation, started over
        else:
            slot = min(idle, key=lambda s: (s.conversation is not None, s.last_used))  # free, else LRU
        if slot.conversation is not None and slot.key == key:
            slot.start_over(conversation_id)
        else:
            slot.close()  # its context is freed before the next is allocated
            slot.hold(start(), key, conversation_id)
        return slot, messages

    def used(self, slot: Slot) -> None:
        slot.last_used, slot.requests = time.time(), slot.requests + 1

    def close(self) -> None:
        for s in self.all:
            s.close()


# -- slot files ---------------------------------------------------------------------------------
# what a slot file's metadata holds: a field of another type is a file not written by kvlite
SLOT_META = {"model": str, "model_bytes": int, "policy": str, "params": dict, "evict": str, "messages": list,
             "rendered": str, "conversation_id": (str, type(None)), "evicted": int}  # fmt: skip
_F16_LAYOUT = {"type_k": "f16", "type_v": "f16", "rotations": [0, 0]}  # slot files from before cache types


@dataclasses.dataclass
class SlotFile:
    """What a slot file holds: the conversation's metadata and the sequence's arrays."""

    meta: dict
    arrays: dict

    def snapshot(self, hidden_layer: int | None) -> Snapshot:
        """The sequence, for a cache that keeps hidden states of hidden_layer (None: none)."""
        a = self.arrays
        return Snapshot(a["blob"].tobytes(), tuple(int(t) for t in a["tokens"]), a["live"], a.get("hidden"),
                        hidden_layer if "hidden" in a else None)  # fmt: skip


def policy_params(policy: Policy) -> dict:
    """The policy's declared parameters, as make_policy takes them."""
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name in ALL_PARAMS}


def cache_layout(ctx) -> dict:
    """What a state blob's bytes mean: the cache types and llama.cpp's rotation of them."""
    return {"type_k": ctx.type_k, "type_v": ctx.type_v, "rotations": list(ctx.rotations)}


def describe_layout(layout) -> str:
    if not isinstance(layout, dict):
        return "unknown"
    rot = "rotated" if any(layout.get("rotations", [])) else "unrotated"
    return f"-ctk {layout.get('type_k')} -ctv {layout.get('type_v')} ({rot})"


def write_slot_file(path: pathlib.Path, slot: Slot, model: Model) -> int:
    """The slot's conversation to a file, written whole and then renamed (a full disk leaves no half
    file). Returns how many tokens it saved."""
    conv = slot.conversation
    runner = conv.runner
    snap, evicted = slot.parked or (runner.cache.snapshot(), runner.cache.evicted)
    meta = {"format": SLOT_FORMAT, "model": model.path.name, "model_bytes": model.path.stat().st_size,
            "policy": runner.policy.name, "params": policy_params(runner.policy), "evict": conv.evict,
            "messages": conv.messages, "rendered": conv.rendered, "conversation_id": slot.conversation_id,
            "evicted": evicted, "cache": cache_layout(runner.ctx)}  # fmt: skip
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8), "live": snap.live,
              "tokens": np.asarray(snap.tokens, np.int32), "blob": np.frombuffer(snap.blob, np.uint8)}  # fmt: skip
    if snap.hidden is not None:
        arrays["hidden"] = snap.hidden
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ApiError(500, f"cannot write {path}: {e.strerror or e}", kind="server_error") from None
    return len(snap.tokens)


def read_slot_file(path: pathlib.Path, where: str, model: Model) -> SlotFile:
    """A slot file written by write_slot_file for this model, checked field by field (where: the
    folder, as the server was told it)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]))
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise ApiError(400, f"no slot file {path.name} in {where}") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise ApiError(400, f"{path.name} is not a kvlite slot file ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != SLOT_FORMAT:
        raise ApiError(400, f"{path.name} is not a kvlite slot file of format {SLOT_FORMAT}")
    _check_meta(path.name, meta)
    if (meta["model"], meta["model_bytes"]) != (model.path.name, model.path.stat().st_size):
        raise ApiError(400, f"{path.name} was saved from {meta['model']}, not {model.path.name}")
    meta.setdefault("cache", _F16_LAYOUT)
    return SlotFile(meta, arrays)


def _check_meta(name: str, meta: dict) -> None:
    for key, kind in SLOT_META.items():
        value = meta.get(key)
        if key not in meta or not isinstance(value, kind) or isinstance(value, bool):
            raise ApiError(400, f"{name} is not a kvlite slot file: its '{key}' is missing or malformed")
    if meta["evicted"] < 0 or meta["model_bytes"] < 0:
        raise ApiError(400, f"{name} is not a kvlite slot file: a negative count")
    for m in meta["messages"]:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ApiError(400, f"{name} is not a kvlite slot file: a message is not a role and a text")
