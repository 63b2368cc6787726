"""EchoKV Eq. 2: proposals, the pre-RoPE query of the last prompt token(s) rotated to the future
decode positions L+1..L+T with the model's own RoPE (ggml's rope, so it matches llama.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import KvliteError
from ..models import ModelInfo
from ..native import native

GGML_ROPE_MODE = {"norm": 0, "neox": 2}


def rope(info: ModelInfo, x: np.ndarray, positions: Sequence[int]) -> np.ndarray:
    """Rotate pre-RoPE vectors x [n, heads, head_dim] to positions [n] exactly as llama.cpp does."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    pos = np.ascontiguousarray(positions, dtype=np.int32)
    if x.ndim != 3 or x.shape[2] != info.head_dim or pos.shape != (x.shape[0],):
        raise KvliteError(f"rope wants x [n, heads, {info.head_dim}] and n positions, got {x.shape} and {pos.shape}")
    out = np.empty_like(x)
    rc = native().lib.kvl_rope(
        native().ctx, x.ctypes.data, pos.ctypes.data, x.shape[0], x.shape[1], x.shape[2], info.rope_dims,
        GGML_ROPE_MODE[info.rope_type], info.rope_n_ctx_orig, info.rope_base, info.rope_freq_scale,
        info.yarn_ext_factor, info.yarn_attn_factor, info.yarn_beta_fast, info.yarn_beta_slow, out.ctypes.data,
    )  # fmt: skip
    if rc != 0:
        raise KvliteError(f"native rope failed (status {rc}) for x{x.shape}")
    return out


def proposals(info: ModelInfo, anchors: np.ndarray, positions: Sequence[int]) -> np.ndarray:
    """anchors: pre-RoPE queries [n_layer, S, n_head, head_dim] (the last S prompt tokens);
    positions: the T future positions. Returns the S*T proposals per layer in attn_pool's query
    layout [n_layer, n_head, S*T, head_dim] (anchor-major: proposal s*T + t is anchor s at t)."""
    n_layer, n_anchor, n_head, d = anchors.shape
    pos = np.asarray(positions, dtype=np.int32)
    t = len(pos)
    x = np.repeat(anchors.reshape(n_layer * n_anchor, 1, n_head, d), t, axis=1).reshape(-1, n_head, d)
    rotated = rope(info, x, np.tile(pos, n_layer * n_anchor))
    return np.ascontiguousarray(rotated.reshape(n_layer, n_anchor * t, n_head, d).transpose(0, 2, 1, 3))
