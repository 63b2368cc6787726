"""Twin of reading a quantized or bf16 KV cache: gguf-py's dequantization (numpy, written apart
from ggml's C) and the Hadamard matrix built by Sylvester's doubling in torch (kvlite builds it
from the popcount formula), so the keys a score reads can be held to these."""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize


def hadamard(n: int) -> torch.Tensor:
    """H_2m = [[H_m, H_m], [H_m, -H_m]] from H_1 = [1], over sqrt(n): float64 [n, n]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"a Hadamard matrix of size {n}: not a power of two")
    return h / n**0.5


def cache_rows(raw: np.ndarray, ggml_type: int, n_per_row: int, rotation: int = 0) -> torch.Tensor:
    """Rows as a state export holds them (bytes [cells, row bytes], or bf16 bits) -> float64
    [cells, n_per_row] as the model made them: dequantized, then every `rotation` consecutive
    values multiplied by H (llama.cpp stores H x; H is its own inverse). rotation 0: none."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(len(raw), -1)
    x = torch.from_numpy(dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(len(raw), n_per_row)).double()
    if rotation:
        x = (x.reshape(-1, rotation) @ hadamard(rotation)).reshape(len(raw), n_per_row)
    return x
