"""The eval callback: copies the intermediate tensors a caller asked for, and asks llama.cpp for
nothing else (every tensor the scheduler is asked about splits the graph there). The callback
itself is C (kvlite's native library): llama.cpp calls it for every graph node, and a Python
callback there slowed decoding down (docs/design.md, "Measured facts the code relies on")."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import llama_cpp
import numpy as np

from ..errors import KvliteError
from ..models import ModelInfo
from ..native import native

# kind -> (node name pattern, op, dims, token axis or None when ubatches don't stack)
# numpy shapes: q/q_pre [T, n_head, D]; k [T, n_head_kv, D]; kq [n_head, T, n_kv];
# hidden [T, n_embd]; k_cache [n_kv, n_head_kv, D].
KINDS = {
    "q": ("Qcur-{il}", "ROPE", 3, 0),  # post-RoPE query
    "q_pre": ("Qcur-{il}", "RESHAPE", 3, 0),  # pre-RoPE query (after the bias on qwen2)
    "k": ("Kcur-{il}", "ROPE", 3, 0),  # post-RoPE key of the new tokens
    "kq": ("kq-{il}", "MUL_MAT", 3, None),  # raw q.k over all n_kv cells (flash attention off)
    "hidden": ("l_out-{il}", "ADD", 2, 0),  # residual stream after layer il
    "k_cache": ("cache_k_l{il} (view)", "VIEW", 3, None),  # the attended part of the K cache
}
# Where a model with Q/K norms (qwen3, gemma3) has its pre-RoPE query: after the norm (src/models/qwen3.cpp).
QK_NORM_NODES = {"q_pre": ("Qcur_normed-{il}", "MUL")}


def node(kind: str, info: ModelInfo) -> tuple[str, str]:
    """The graph node (name pattern, op) that holds `kind` in this model's llama.cpp graph."""
    if info.qk_norm and kind in QK_NORM_NODES:
        return QK_NORM_NODES[kind]
    return KINDS[kind][:2]


class Capture:
    """Records, per ubatch, the requested (kind, layer) tensors of every decode while enabled, for
    one model's graph (info: where its nodes are)."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self._native = native()
        self.ptr = self._native.capture_new()
        self._wants: list[tuple[str, int]] = []  # the native want index -> (kind, layer)
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._native.capture_callback())
        self.user_data = self.ptr  # llama.cpp hands it back to the callback

    def close(self) -> None:
        if getattr(self, "ptr", None):
            self._native.capture_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()

    @property
    def enabled(self) -> bool:
        return self._enabled if hasattr(self, "_enabled") else True

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = bool(on)
        self._native.capture_enable(self.ptr, on)

    def request(self, kind: str, layers: Iterable[int]) -> None:
        pattern, op = node(kind, self.info)
        for il in layers:
            if (kind, il) in self._wants:
                continue
            if self._native.capture_want(self.ptr, pattern.format(il=il), op) < 0:
                raise ValueError("too many capture requests")
            self._wants.append((kind, il))

    def clear(self) -> None:
        self._native.capture_clear(self.ptr)

    def take(self, kind: str, layer: int) -> np.ndarray | list[np.ndarray]:
        """get(), then forget those records (others stay)."""
        out = self.get(kind, layer)
        self._native.capture_drop(self.ptr, self._wants.index((kind, layer)))
        return out

    def wants(self, kind: str, layer: int) -> bool:
        return (kind, layer) in self._wants

    @property
    def data(self) -> dict[tuple[str, int], list[np.ndarray]]:
        """Everything captured since the last clear: (kind, layer) -> one array per ubatch."""
        return self._records()

    def _records(self, only: tuple[str, int] | None = None) -> dict[tuple[str, int], list[np.ndarray]]:
        out: dict[tuple[str, int], list[np.ndarray]] = {}
        index = None if only is None else self._wants.index(only)
        for want, a in self._native.capture_records(self.ptr, index):
            kind, il = self._wants[want]
            dims = KINDS[kind][2]
            out.setdefault((kind, il), []).append(a.reshape(a.shape[-dims:]))  # ggml's unit dims dropped
        return out

    def get(self, kind: str, layer: int) -> np.ndarray | list[np.ndarray]:
        """The captured tensor, ubatches stacked along tokens; a list of per-ubatch arrays for kinds
        whose n_kv can change between ubatches (kq, k_cache). Copies only that tensor's records."""
        if (kind, layer) not in self._wants:
            raise KeyError(f"nothing captured for {kind} of layer {layer}")
        parts = self._records((kind, layer)).get((kind, layer), [])
        if not parts:
            raise KeyError(f"nothing captured for {kind} of layer {layer}")
        axis = KINDS[kind][3]
        return parts if axis is None else np.concatenate(parts, axis=axis)

    def for_lane(self, lane: int) -> Capture | LaneCapture:
        """What a cache on `lane` reads its records from (a plain capture: itself)."""
        return self


class PoolCapture(Capture):
    """The one eval callback of a pool's context (Context(lanes=N)), shared by its caches: each lane
    gets a LaneCapture with its own switch and its own records. A decode step (engine.batcher)
    records while the switch of any lane in it is on; then its records are dealt out, each lane's
    rows of the batch to that lane, if its switch is on. Every kind it records has a token axis."""

    def __init__(self, info: ModelInfo) -> None:
        super().__init__(info)
        self.views: dict[int, LaneCapture] = {}
        self.enabled = False  # set for each step
        self.lock = threading.RLock()  # the pool's context's, once it has one

    def view(self, lane: int) -> LaneCapture:
        self.views[lane] = LaneCapture(self, lane)
        return self.views[lane]

    def for_lane(self, lane: int) -> LaneCapture:
        return self.views[lane]

    def lane_on(self, lane: int) -> bool:
        view = self.views.get(lane)
        return view is not None and view.on

    def request(self, kind: str, layers: Iterable[int]) -> None:
        if KINDS[kind][3] is None:
            raise KvliteError(f"a pool's capture deals rows by token; {kind} has no token axis")
        with self.lock:
            super().request(kind, layers)

    def deal(self, spans: list[tuple[int, int]]) -> None:
        """The last step's records to its lanes: spans, (lane, tokens) in batch order."""
        records = {key: np.concatenate(parts) for key, parts in self._records().items()}
        self.clear()
        start = 0
        for lane, n in spans:
            if self.lane_on(lane):
                stash = self.views[lane].stash
                for key, rows in records.items():
                    stash.setdefault(key, []).append(rows[start : start + n])
            start += n


class LaneCapture:
    """One lane's capture in a pool (PoolCapture): what a Runner uses as its Capture."""

    def __init__(self, pool: PoolCapture, lane: int) -> None:
        self.pool, self.lane = pool, lane
        self.on = True  # as a new Capture: recording until switched off
        self.stash: dict[tuple[str, int], list[np.ndarray]] = {}  # its rows of each step, per (kind, layer)

    @property
    def enabled(self) -> bool:
        return self.on

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.on = bool(on)

    def request(self, kind: str, layers: Iterable[int]) -> None:
        self.pool.request(kind, layers)

    def wants(self, kind: str, layer: int) -> bool:
        return self.pool.wants(kind, layer)

    def clear(self) -> None:
        self.stash = {}

    @property
    def data(self) -> dict[tuple[str, int], list[np.ndarray]]:
        return {key: list(parts) for key, parts in self.stash.items()}

    def get(self, kind: str, layer: int) -> np.ndarray:
        parts = self.stash.get((kind, layer))
        if not parts:
            raise KeyError(f"nothing captured for {kind} of layer {layer}")
        return np.concatenate(parts, axis=KINDS[kind][3])

    def take(self, kind: str, layer: int) -> np.ndarray:
        out = self.get(kind, layer)
        del self.stash[(kind, layer)]
        return out
