"""The live sequence's keys and values as llama.cpp cached them, read from its state export a
layer at a time (CachedKV), and beside them the evicted cells a recall store holds (JointKV): what
the scores read."""

from __future__ import annotations

import numpy as np

from .engine import cachetypes, kvstate
from .errors import KvliteError
from .models import ModelInfo
from .native import native


class CachedKV:
    """The live sequence's keys and values as llama.cpp cached them (post-RoPE keys), read from its
    state export one layer at a time (kvstate.StateFile), so an eviction holds one layer, not the
    cache twice. positions: [n] ascending; layer(il): keys [n_head_kv, n, head_dim] in that order, as
    attention reads them; k_rows/v_rows(il): the rows as stored. layers: the model's layers whose
    cache holds every cell (all but sliding-window ones, ModelInfo.full_layers), the ones readable.
    Rows of a quantized or bf16 cache come back as float32 vectors as the model made them:
    dequantized by ggml, then rotated back by the Hadamard matrices of `rotations` (K's and V's
    sizes, 0: none; Context.rotations), so every score reads the same vectors whatever the type."""

    def __init__(self, sf: kvstate.StateFile, info: ModelInfo, rotations: tuple[int, int] = (0, 0)):
        self.file, self.n_head_kv = sf, info.n_head_kv
        self.rotations = rotations
        self.n_embd_kv = info.n_head_kv * info.head_dim
        self.order = sf.by_position
        self.positions = sf.pos[self.order]
        self.layers = info.full_layers
        if sf.n_layer != len(self.layers):
            raise KvliteError(f"the state export holds {sf.n_layer} full layers, the model {len(self.layers)}")
        self._index = {il: i for i, il in enumerate(self.layers)}  # model layer -> the export's

    def _at(self, il: int) -> int:
        if il not in self._index:
            raise KvliteError(f"layer {il} slides over a window: its cache holds only the last cells")
        return self._index[il]

    def layer(self, il: int, cells: np.ndarray | None = None) -> np.ndarray:
        """Layer il's keys [n_head_kv, n, head_dim]; cells: only these (indices into `positions`)."""
        ggml_type, heads = self.layer_blocks(il, cells)
        if heads.dtype != np.uint8:
            return heads
        n = heads.shape[1]
        head_dim = self.n_embd_kv // self.n_head_kv
        return self._floats(heads.reshape(self.n_head_kv * n, -1), ggml_type, self.rotations[0], head_dim).reshape(
            self.n_head_kv, n, head_dim
        )

    def layer_blocks(self, il: int, cells: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Layer il's keys heads-first as stored: (ggml type, [n_head_kv, n, head_dim] f32 or f16, or
        the bytes [n_head_kv, n, head bytes] of another type: blocks never straddle heads,
        cachetypes.check_head_dim), still rotated (rotations[0]) for a quantized type."""
        order = self.order if cells is None else self.order[cells]
        at = self._at(il)
        return self.file.layout.k_types[at][0], heads_first(self.file.k(at, order), self.n_head_kv)

    def k_rows(self, il: int) -> np.ndarray:
        """Layer il's K rows [n, n_head_kv * head_dim] (f32 or f16 as stored; other types as f32), in
        the order of `positions`."""
        at = self._at(il)
        return self._floats(self.file.k(at, self.order), self.file.layout.k_types[at][0], self.rotations[0])

    def v_rows(self, il: int) -> np.ndarray:
        at = self._at(il)
        return self._floats(self.file.v(at, self.order), self.file.layout.v_types[at][0], self.rotations[1])

    def _floats(self, rows: np.ndarray, ggml_type: int, rotation: int, n_per_row: int | None = None) -> np.ndarray:
        """Rows as the model made them: f32/f16 as they are; other types widened by ggml, then
        turned back from llama.cpp's rotation (in place, in the one f32 copy)."""
        if rows.dtype in (np.float32, np.float16):  # numpy reads them as they are
            return rows
        raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)  # bf16 bits or quantized blocks
        return cachetypes.unrotate(native().to_float(ggml_type, raw, n_per_row or self.n_embd_kv), rotation)

    def close(self) -> None:
        self.file.close()


def heads_first(rows: np.ndarray, n_head_kv: int) -> np.ndarray:
    """K rows [n, n_head_kv * head_dim] as stored -> [n_head_kv, n, head_dim] (f32 or f16), or the
    bytes [n_head_kv, n, head bytes] of another type."""
    heads = np.ascontiguousarray(rows.reshape(len(rows), n_head_kv, -1).transpose(1, 0, 2))
    if heads.dtype not in (np.float32, np.float16):
        heads = heads.view(np.uint8).reshape(n_head_kv, len(rows), -1)
    return heads


class JointKV:
    """The resident cells' keys (CachedKV) and the store's evicted ones together, in position order:
    what a recall scores, as attention would weigh a recalled cell beside the resident ones."""

    def __init__(self, resident: CachedKV, store: kvstate.SeqState):
        self.resident, self.stored = resident, store.streams[0]
        self.rotations, self.layers = resident.rotations, resident.layers
        both = np.concatenate([resident.positions, self.stored.pos])
        self.order = np.argsort(both, kind="stable")
        self.positions = both[self.order]

    def layer_blocks(self, il: int) -> tuple[int, np.ndarray]:
        k_type, heads = self.resident.layer_blocks(il)
        stored = heads_first(self.stored.k[self.resident._at(il)], self.resident.n_head_kv)
        return k_type, np.ascontiguousarray(np.concatenate([heads, stored], axis=1)[:, self.order])

    def close(self) -> None:
        self.resident.close()
