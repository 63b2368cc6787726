"""The slot-file codec: a conversation's compressed cache (llama.cpp's state blob of its sequence,
as a cache.Snapshot) and what kvlite knows beside it (messages, policy, cache types, the cap).
`kvlite serve` writes and reads these for /slots, `kvlite chat` for /save and /load."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zipfile

import numpy as np

from . import recall_store
from .api import ROLES, Conversation
from .cache import Snapshot
from .engine import Model, kvstate
from .errors import KvliteError
from .policies import ALL_PARAMS, Policy, make_policy

SLOT_FORMAT = 1
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
        store = recall_store.keep(kvstate.parse(a["store"].tobytes())) if "store" in a else None
        return Snapshot(a["blob"].tobytes(), tuple(int(t) for t in a["tokens"]), a["live"], a.get("hidden"),
                        hidden_layer if "hidden" in a else None, store)  # fmt: skip

    @property
    def recall(self) -> int:
        """The conversation's recall (Session.conversation's), 0 in a file from before it."""
        recall = self.meta.get("recall", 0)
        return recall if isinstance(recall, int) and not isinstance(recall, bool) and recall >= 0 else 0

    def policy(self) -> Policy:
        try:
            return make_policy(self.meta["policy"], **self.meta["params"])
        except (KvliteError, TypeError, ValueError) as e:
            raise KvliteError(f"its policy cannot be made here: {e}") from None

    @property
    def cap(self) -> int | None:
        """The cache cap the conversation ran under (None: a file from before it was kept)."""
        cap = self.meta.get("cap")
        return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None

    def check_layout(self, conv: Conversation, name: str) -> None:
        """Refuse a cache of other types than conv's context holds."""
        here = cache_layout(conv.runner.ctx)
        if self.meta["cache"] != here:  # llama.cpp would load a rotated cache into an unrotated one without a word
            raise KvliteError(f"{name} holds a {describe_layout(self.meta['cache'])} cache; this one is "
                              f"{describe_layout(here)}: run with those -ctk/-ctv")  # fmt: skip

    def restore(self, conv: Conversation, snap: Snapshot) -> None:
        """Continue the saved conversation in conv (made under the file's policy), its cache snap."""
        conv.resume(snap, self.meta["messages"], self.meta["rendered"], self.meta["evicted"])


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


def write_slot_file(path: pathlib.Path, conv: Conversation, model: Model, parked: tuple[Snapshot, int] | None = None,
                    conversation_id: str | None = None) -> int:  # fmt: skip
    """The conversation to a file, written whole and then renamed (a full disk leaves no half
    file). parked: its cache as set aside in host memory, if it is. Returns how many tokens it saved."""
    runner = conv.runner
    snap, evicted = parked or (runner.cache.snapshot(), runner.cache.evicted)
    meta = {"format": SLOT_FORMAT, "model": model.path.name, "model_bytes": model.path.stat().st_size,
            "policy": runner.policy.name, "params": policy_params(runner.policy), "evict": conv.evict,
            "messages": conv.messages, "rendered": conv.rendered, "conversation_id": conversation_id,
            "evicted": evicted, "cache": cache_layout(runner.ctx), "cap": conv.cap,
            "recall": runner.recall_cells}  # fmt: skip
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8), "live": snap.live,
              "tokens": np.asarray(snap.tokens, np.int32), "blob": np.frombuffer(snap.blob, np.uint8)}  # fmt: skip
    if snap.hidden is not None:
        arrays["hidden"] = snap.hidden
    if snap.store is not None:
        arrays["store"] = np.frombuffer(kvstate.build(snap.store), np.uint8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KvliteError(f"cannot write {path}: {e.strerror or e}") from None
    return len(snap.tokens)


def read_slot_file(path: pathlib.Path, where: str, model_path: pathlib.Path) -> SlotFile:
    """A slot file written by write_slot_file for the model at model_path, checked field by field
    (where: the folder, as the user named it)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]))
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise KvliteError(f"no slot file {path.name} in {where}") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise KvliteError(f"{path.name} is not a kvlite slot file ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != SLOT_FORMAT:
        raise KvliteError(f"{path.name} is not a kvlite slot file of format {SLOT_FORMAT}")
    _check_meta(path.name, meta)
    if (meta["model"], meta["model_bytes"]) != (model_path.name, model_path.stat().st_size):
        raise KvliteError(f"{path.name} was saved from {meta['model']}, not {model_path.name}")
    meta.setdefault("cache", _F16_LAYOUT)
    return SlotFile(meta, arrays)


def _check_meta(name: str, meta: dict) -> None:
    for key, kind in SLOT_META.items():
        value = meta.get(key)
        if key not in meta or not isinstance(value, kind) or isinstance(value, bool):
            raise KvliteError(f"{name} is not a kvlite slot file: its '{key}' is missing or malformed")
    if meta["evicted"] < 0 or meta["model_bytes"] < 0:
        raise KvliteError(f"{name} is not a kvlite slot file: a negative count")
    for m in meta["messages"]:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise KvliteError(f"{name} is not a kvlite slot file: a message is not a role and a text")
