"""EchoKV Eq. 2: proposals, the pre-RoPE query of the last prompt token(s) rotated to the future
decode positions L+1..L+T with the model's own RoPE (ggml's rope, so it matches llama.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import KvliteError
from ..models import ModelInfo
from ..native import RopeParams, native


def rope(info: ModelInfo, x: np.ndarray, positions: Sequence[int], layer: int = 0) -> np.ndarray:
    """Rotate pre-RoPE vectors x [n, heads, head_dim] of `layer` to positions [n] exactly as llama.cpp
    does (a sliding-window layer has its own base)."""
    x = np.asarray(x, dtype=np.float32)
    pos = np.asarray(positions, dtype=np.int32)
    if x.ndim != 3 or x.shape[2] != info.head_dim or pos.shape != (x.shape[0],):
        raise KvliteError(f"rope wants x [n, heads, {info.head_dim}] and n positions, got {x.shape} and {pos.shape}")
    return native().rope(RopeParams.of(info, layer), x, pos)


def spread(steps: int, count: int | None) -> np.ndarray:
    """`count` of the offsets 0..steps-1, evenly spread from the first to the last (None: all)."""
    if count is None or count >= steps:
        return np.arange(steps)
    return np.unique(np.linspace(0, steps - 1, count).round().astype(np.int64))


def proposals(info: ModelInfo, anchors: np.ndarray, positions: Sequence[int], layers: Sequence[int]) -> np.ndarray:
    """anchors: pre-RoPE queries [n_layer, S, n_head, head_dim] (the last S prompt tokens) of the
    model's `layers`; positions: the T future positions. Returns the S*T proposals per layer in
    attn_pool's query layout [n_layer, n_head, S*T, head_dim] (anchor-major: proposal s*T + t is
    anchor s at t)."""
    n_layer, n_anchor, n_head, d = anchors.shape
    if len(layers) != n_layer:
        raise KvliteError(f"proposals: anchors of {n_layer} layers, {len(layers)} layers named")
    pos = np.asarray(positions, dtype=np.int32)
    t = len(pos)
    out = np.empty((n_layer, n_head, n_anchor * t, d), np.float32)
    for i, il in enumerate(layers):  # a layer at a time: the temporaries stay one layer's
        x = np.repeat(anchors[i].reshape(n_anchor, 1, n_head, d), t, axis=1).reshape(-1, n_head, d)
        out[i] = rope(info, x, np.tile(pos, n_anchor), il).transpose(1, 0, 2)
    return out
