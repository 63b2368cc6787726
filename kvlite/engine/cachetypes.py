"""KV cache types as llama.cpp names them (-ctk/-ctv), flash attention (-fa), and what a quantized
cache holds: blocks of 32 values, and, for a quantized type on heads a multiple of 64 wide, the
vectors after a Hadamard rotation (llama.cpp's src/llama-kv-cache.cpp, attn_rot_k/attn_rot_v:
the graph rotates Q and K alike, so q.k is unchanged, and V is rotated back after attention).
kvlite reads such rows back as the model's vectors: dequantized, then rotated back (docs/cache.md,
"Quantized caches")."""

from __future__ import annotations

import functools
import os
import re

import llama_cpp as L
import numpy as np

from .. import gguf_header
from ..errors import KvliteError

# common/arg.cpp's kv_cache_types, in its order
CACHE_TYPES = {
    "f32": L.GGML_TYPE_F32,
    "f16": L.GGML_TYPE_F16,
    "bf16": 30,  # GGML_TYPE_BF16 (llama_cpp does not name it)
    "q8_0": L.GGML_TYPE_Q8_0,
    "q4_0": L.GGML_TYPE_Q4_0,
    "q4_1": L.GGML_TYPE_Q4_1,
    "iq4_nl": L.GGML_TYPE_IQ4_NL,
    "q5_0": L.GGML_TYPE_Q5_0,
    "q5_1": L.GGML_TYPE_Q5_1,
}
UNQUANTIZED = ("f32", "f16", "bf16")
BLOCK = 32  # values per block of every quantized cache type above
# -fa's values and llama.cpp's spellings of them (common/arg.cpp)
FLASH_ATTN = {
    **dict.fromkeys(("on", "enabled", "true", "1"), "on"),
    **dict.fromkeys(("off", "disabled", "false", "0"), "off"),
    **dict.fromkeys(("auto", "-1"), "auto"),
}
ROTATION_ENV = "LLAMA_ATTN_ROT_DISABLE"


def check_types(type_k: str, type_v: str, flash_attn: str) -> str:
    """Validate -ctk/-ctv/-fa; returns -fa's canonical value (on, off or auto)."""
    for flag, name in (("-ctk", type_k), ("-ctv", type_v)):
        if name not in CACHE_TYPES:
            raise KvliteError(f"{flag} {name!r}: the cache types are {', '.join(CACHE_TYPES)}")
    fa = FLASH_ATTN.get(str(flash_attn).lower())
    if fa is None:
        raise KvliteError(f"-fa {flash_attn!r}: use on, off or auto")
    if fa == "off" and quantized(type_v):
        raise KvliteError(f"-ctv {type_v} needs flash attention (llama.cpp reads a quantized V only there): "
                          "use -fa on or auto, or -ctv f16")  # fmt: skip
    return fa


def quantized(name: str) -> bool:
    return name not in UNQUANTIZED


def flash_attn_on(fa: str, type_v: str) -> bool:
    """auto: on where a quantized V needs it, off otherwise (off decodes faster on CPU, docs/cache.md)."""
    return fa == "on" or (fa == "auto" and quantized(type_v))


def check_head_dim(type_k: str, type_v: str, head_dim: int) -> None:
    for flag, name in (("-ctk", type_k), ("-ctv", type_v)):
        if quantized(name) and head_dim % BLOCK:
            raise KvliteError(f"{flag} {name} stores blocks of {BLOCK} values; this model's heads are {head_dim} "
                              "wide: use f16, bf16 or f32")  # fmt: skip


def row_bytes(name: str, n: int) -> int:
    """Bytes of n values of a cache type (n a multiple of its block)."""
    return gguf_header.row_bytes(CACHE_TYPES[name], n)


def rotation_disabled() -> bool:
    """llama.cpp's own test: atoi(LLAMA_ATTN_ROT_DISABLE) != 0, read when a context is made."""
    m = re.match(r"\s*([+-]?\d+)", os.environ.get(ROTATION_ENV, ""))
    return bool(m and int(m.group(1)))


def rotations(type_k: str, type_v: str, head_dim: int) -> tuple[int, int]:
    """The Hadamard sizes llama.cpp rotates K and V rows by (0: not rotated), for a context made
    now: K by the largest power of two dividing the head size, V by 64 (llama-kv-cache.cpp,
    build_input_k_rot/build_input_v_rot)."""
    if rotation_disabled() or head_dim % 64:
        return 0, 0
    n_k = 64
    while head_dim % (2 * n_k) == 0:
        n_k *= 2
    return (n_k if quantized(type_k) else 0), (64 if quantized(type_v) else 0)


@functools.cache
def hadamard(n: int) -> np.ndarray:
    """llama.cpp's ggml_gen_hadamard: Sylvester's matrix in natural order over sqrt(n),
    H[i, j] = (-1)^popcount(i & j) / sqrt(n); symmetric and orthonormal, so its own inverse."""
    i = np.arange(n)
    bits = np.bitwise_and.outer(i, i)
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return ((1 - 2 * parity) / np.sqrt(n)).astype(np.float32)


def unrotate(rows: np.ndarray, n: int, block: int = 8192) -> np.ndarray:
    """f32 rows (any shape whose last axis holds whole n-chunks, within one head since n divides the
    head size) as the model made them: every n consecutive values multiplied by H_n again, in
    place, a block of chunks at a time (no second copy of a layer)."""
    if n:
        flat, h = rows.reshape(-1, n), hadamard(n)
        for s in range(0, len(flat), block):
            flat[s : s + block] = flat[s : s + block] @ h
    return rows
