"""The eval callback: copies the intermediate tensors a caller asked for, and asks llama.cpp for
nothing else (every tensor the scheduler is asked about splits the graph there)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import llama_cpp
import numpy as np

from .ggml_tensor import GgmlTensor, op_name, tensor_to_numpy

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


class Capture:
    """Records, per ubatch, the requested (kind, layer) tensors of every decode while enabled."""

    def __init__(self) -> None:
        # node name -> {op -> (kind, layer)}: one name labels several nodes (e.g. Qcur-3 before
        # and after RoPE), told apart by their op
        self._wanted: dict[bytes, dict[str, tuple[str, int]]] = {}
        self.data: dict[tuple[str, int], list[np.ndarray]] = {}
        self.enabled = True

        @llama_cpp.ggml_backend_sched_eval_callback
        def _callback(tensor_ptr, ask, _user):
            if not self.enabled or not self._wanted:
                return not ask  # ask: not interested; after compute: carry on
            name = ctypes.cast(tensor_ptr, ctypes.POINTER(GgmlTensor)).contents.name
            by_op = self._wanted.get(name)
            hit = by_op and by_op.get(op_name(tensor_ptr))
            if not hit:
                return not ask
            if not ask:
                a = tensor_to_numpy(tensor_ptr)
                dims = KINDS[hit[0]][2]
                self.data.setdefault(hit, []).append(a.reshape(a.shape[-dims:]))  # drop ggml's unit dims
            return True

        self.callback = _callback  # keep a reference: llama.cpp holds only the raw pointer

    def request(self, kind: str, layers: Iterable[int]) -> None:
        pattern, op, _, _ = KINDS[kind]
        for il in layers:
            self._wanted.setdefault(pattern.format(il=il).encode(), {})[op] = (kind, il)

    def forget(self) -> None:
        """Stop asking for anything and drop what was captured."""
        self._wanted.clear()
        self.data.clear()

    def clear(self) -> None:
        self.data.clear()

    def get(self, kind: str, layer: int) -> np.ndarray | list[np.ndarray]:
        """The captured tensor, ubatches stacked along tokens; a list of per-ubatch arrays for kinds
        whose n_kv can change between ubatches (kq, k_cache)."""
        parts = self.data.get((kind, layer), [])
        if not parts:
            raise KeyError(f"nothing captured for {kind} of layer {layer}")
        axis = KINDS[kind][3]
        return parts if axis is None else np.concatenate(parts, axis=axis)
