"""The ranges every surface (CLI flags, TOML configs, the Python API, the server) holds numbers to
before they reach llama.cpp's 32-bit fields or a buffer size: one check, one wording."""

from __future__ import annotations

import math

from .errors import KvliteError

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
MAX_THREADS = 512  # GGML_MAX_N_THREADS: ggml's thread pool has no room for more
# The prefill chunk (llama.cpp's batch: --chunk, RunSettings.chunk, an eval cell's `h`), which is also
# chunked mode's refresh interval: one default for every surface
DEFAULT_CHUNK = 512


def check_int(name: str, value: object, lo: int = 0, hi: int = INT32_MAX) -> int:
    """value as an int in [lo, hi], or a one-line error naming `name` (a flag or a field)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            value = int(value)
        else:
            raise KvliteError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise KvliteError(f"{name} must be in {lo}..{hi}, got {value}")
    return value


def kind_of(value: object) -> str:
    """How an error names a JSON value of the wrong type: its type, or the value itself if short."""
    kinds = {dict: "an object", list: "a list", type(None): "null", bool: "a boolean"}
    return kinds.get(type(value)) or (repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}")


def check_pool_kernel(name: str, value: int) -> None:
    """A max-pool width (--pool-kernel, attn_pool's pool_kernel): odd, so that the window is centred
    on its cell, or 0 / 1 for none. The policy parameters' `odd` declaration and the native kernel's
    guard both ask here."""
    if value < 0 or (value > 1 and value % 2 == 0):
        raise KvliteError(f"{name} must be odd (or 0), got {value}")


def check_threads(name: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        raise KvliteError(f"{name} must be a positive number of threads, got {value}")
    return check_int(name, value, 1, MAX_THREADS)
