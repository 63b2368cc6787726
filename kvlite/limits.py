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


Budget = int | str  # KV cells, or a share of the prompt as "25%" (kvpress's compression ratio 0.75)


def parse_budget(value: object, flag: str = "--budget") -> Budget:
    """A budget: KV cells (an integer), or a share of the prompt ("2%", "12.5%", written back as
    "12.5%"), which a policy turns into cells once it knows the prompt (cells_for)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = math.nan
        if not 0 < share <= 100:  # NaN fails it too
            raise KvliteError(f"{flag} {value!r}: a share of the prompt is a percentage in (0, 100], as 12.5%")
        return f"{share:g}%"
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise KvliteError(f"{flag} {value!r}: give KV cells (128) or a share of the prompt (2%)") from None
    return check_int(flag, value, 1)


def cells_for(budget: Budget | None, n_prompt: int) -> int | None:
    """What a budget keeps of an n-token prompt: a share rounds down, as kvpress's presses do (at
    least one cell)."""
    if not isinstance(budget, str):
        return budget
    return max(1, int(n_prompt * float(budget[:-1]) / 100))


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
