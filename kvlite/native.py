"""ctypes binding of kvlite's native library (native/*.c): the ggml score kernels and the eval
callback's capture. The only module that touches the library: everything else calls the typed
methods below with numpy arrays.

The library is built by `pip install .` (scikit-build-core) against the ggml that llama-cpp-python
installs. A missing or stale build is an error: there is no slower fallback.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import llama_cpp  # noqa: F401  -- maps libggml* first, so the kernels share llama.cpp's ggml
import numpy as np

from .errors import KvliteError
from .gguf_header import row_bytes
from .limits import check_pool_kernel, check_threads

if TYPE_CHECKING:
    from .models import ModelInfo

T = TypeVar("T")

ABI_VERSION = 15
_LIB_NAME = {"darwin": "libkvlite_native.dylib", "win32": "kvlite_native.dll"}.get(sys.platform, "libkvlite_native.so")
_REBUILD = "reinstall kvlite (pip install .) to rebuild it"

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
MASKED = -1e30  # additive logit of a key outside the softmax: exp underflows to exactly 0, no inf - inf


GGML_ROPE_MODE = {"norm": 0, "neox": 2}
_DEVICE_TYPES = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type
# The architectures native/counter_causal.c runs: the dense SwiGLU block of llama.cpp's llama,
# qwen2 and qwen3 graphs (src/models/), with optional Q bias and Q norm.
COUNTER_CAUSAL_ARCHS = ("llama", "qwen2", "qwen3")


def counter_causal_unsupported(info: ModelInfo) -> str | None:
    """Why native/counter_causal.c cannot run this model's blocks (None: it can)."""
    if info.arch not in COUNTER_CAUSAL_ARCHS:
        return f"the native pass supports {', '.join(COUNTER_CAUSAL_ARCHS)}, not '{info.arch}'"
    return None


class RopeParams(ctypes.Structure):
    """struct kvl_rope (native/kvl.h): ggml_rope_ext's arguments for one model."""

    _fields_ = [(name, ctypes.c_int32) for name in ("mode", "n_dims", "n_ctx_orig")]
    _fields_ += [(name, ctypes.c_float) for name in ("freq_base", "freq_scale", "ext_factor", "attn_factor",
                                                      "beta_fast", "beta_slow")]  # fmt: skip
    _fields_ += [("freq_factors", ctypes.c_void_p)]

    @classmethod
    def of(cls, info: ModelInfo, layer: int = 0) -> RopeParams:
        """Layer `layer`'s RoPE: a sliding-window layer has its own base and no frequency scaling
        (llama_model::get_rope_freq_base / get_rope_freq_scale)."""
        factors = None if info.rope_freq_factors is None else np.asarray(info.rope_freq_factors, np.float32)
        swa = layer in info.swa_layers
        params = cls(
            mode=GGML_ROPE_MODE[info.rope_type], n_dims=info.rope_dims, n_ctx_orig=info.rope_n_ctx_orig,
            freq_base=info.layer_rope_base(layer), freq_scale=1.0 if swa else info.rope_freq_scale,
            ext_factor=info.yarn_ext_factor,
            attn_factor=info.yarn_attn_factor, beta_fast=info.yarn_beta_fast, beta_slow=info.yarn_beta_slow,
            freq_factors=_ptr(factors),
        )  # fmt: skip
        params._keep = factors  # the struct points into it
        return params


class HParams(ctypes.Structure):
    """struct kvl_hparams (native/kvl.h): what a counter-causal pass needs to know of a model."""

    _fields_ = [(name, ctypes.c_int32) for name in ("qk_norm", "n_layer", "n_embd", "n_head", "n_head_kv",
                                                     "head_dim")]  # fmt: skip
    _fields_ += [("n_vocab", ctypes.c_int32), ("rms_eps", ctypes.c_float), ("rope", RopeParams)]

    @classmethod
    def of(cls, info: ModelInfo) -> HParams:
        if why := counter_causal_unsupported(info):
            raise KvliteError(f"counter-causal scoring: {why}")
        rope = RopeParams.of(info)
        params = cls(
            qk_norm=int(info.qk_norm), n_layer=info.n_layer, n_embd=info.n_embd, n_head=info.n_head,
            n_head_kv=info.n_head_kv, head_dim=info.head_dim, n_vocab=info.n_vocab, rms_eps=info.rms_eps, rope=rope,
        )  # fmt: skip
        params._keep = rope._keep
        return params


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _find_library() -> pathlib.Path:
    # Installed next to this file; an editable/source checkout may hold it in build/.
    here = pathlib.Path(__file__).resolve().parent
    candidates = [here / _LIB_NAME, *sorted(here.parent.glob(f"build/*/{_LIB_NAME}"))]
    for path in candidates:
        if path.exists():
            return path
    raise KvliteError(f"kvlite's native library ({_LIB_NAME}) is missing: {_REBUILD}")


class Native:
    """The loaded library and its backends (a device and the CPU, kvl_init), reused across calls.

    device: the ggml device the kernels run on ("CUDA0", "Metal", "RPC0", ...; "cpu": none).
    None: $KVLITE_DEVICE, else the first GPU ggml sees (where llama.cpp keeps an offloaded cache),
    else the CPU."""

    def __init__(self, n_threads: int | None = None, path: str | pathlib.Path | None = None, device: str | None = None):
        self._ctx = None
        # The kernels share one scheduler and its buffers: a server's conversations evict from
        # several threads, one kernel at a time, on the thread that runs llama.cpp's decodes when
        # one does (a pool's batcher: executor). With OpenMP a second thread computing ggml graphs
        # brings a second team of workers, which slows llama_decode for good (docs/design.md).
        self.lock = threading.Lock()
        self.executor: Callable[[Callable[[], T]], T] | None = None
        path = pathlib.Path(path) if path else _find_library()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KvliteError(f"cannot load {path}: {e}; {_REBUILD}") from None
        try:
            lib.kvl_abi_version.restype = ctypes.c_int
            abi = lib.kvl_abi_version()
        except AttributeError:
            raise KvliteError(f"{path} is not kvlite's native library; {_REBUILD}") from None
        if abi != ABI_VERSION:
            raise KvliteError(f"{path} is stale (ABI {abi}, this kvlite needs {ABI_VERSION}); {_REBUILD}")
        lib.kvl_init.restype = ctypes.c_void_p
        lib.kvl_init.argtypes = [ctypes.c_int, ctypes.c_char_p]
        lib.kvl_device.restype, lib.kvl_device.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        lib.kvl_free.argtypes = [ctypes.c_void_p]
        lib.kvl_set_threads.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.kvl_free_buffers.argtypes = [ctypes.c_void_p]
        lib.kvl_attn_pool.restype = ctypes.c_int
        lib.kvl_attn_pool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kvl_attn_pool.argtypes += [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_void_p]
        lib.kvl_to_float.restype = ctypes.c_int
        lib.kvl_to_float.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.kvl_to_float.argtypes += [ctypes.c_int64] * 2
        lib.kvl_rope.restype = ctypes.c_int
        lib.kvl_rope.argtypes = [ctypes.c_void_p, ctypes.POINTER(RopeParams), ctypes.c_void_p, ctypes.c_void_p]
        lib.kvl_rope.argtypes += [ctypes.c_int] * 3 + [ctypes.c_void_p]
        lib.kvl_model_load.restype = ctypes.c_void_p
        lib.kvl_model_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(HParams)]
        lib.kvl_model_free.argtypes = [ctypes.c_void_p]
        for fn in (lib.kvl_cc_embed, lib.kvl_cc_layer, lib.kvl_cc_output):
            fn.restype = ctypes.c_int
        lib.kvl_cc_embed.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
        lib.kvl_cc_layer.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4
        lib.kvl_cc_layer.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
        lib.kvl_cc_output.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3
        lib.kvl_capture_new.restype = ctypes.c_void_p
        for fn in (lib.kvl_capture_free, lib.kvl_capture_clear):
            fn.argtypes = [ctypes.c_void_p]
        lib.kvl_capture_want.restype = ctypes.c_int
        lib.kvl_capture_count.restype = ctypes.c_int
        lib.kvl_capture_drop.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.kvl_capture_want.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        lib.kvl_capture_enable.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.kvl_capture_count.argtypes = [ctypes.c_void_p]
        lib.kvl_capture_record.restype = ctypes.POINTER(ctypes.c_float)
        lib.kvl_capture_record.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
        self._lib = lib
        device = device or os.environ.get("KVLITE_DEVICE") or default_device()
        self.n_threads = n_threads or default_threads()
        self._ctx = lib.kvl_init(self.n_threads, None if device.lower() == "cpu" else device.encode())
        if not self._ctx:
            names = ", ".join(d["name"] for d in devices())
            raise KvliteError(f"kvlite's native library could not start ggml device '{device}' (ggml sees: {names})")
        self.device = lib.kvl_device(self._ctx).decode()
        self.path = path

    def set_threads(self, n_threads: int) -> None:
        """The CPU threads every kernel runs with from now on (-t; llama.cpp's decode takes the same)."""
        check_threads("-t", n_threads)
        if n_threads != self.n_threads:
            self._run(lambda: self._lib.kvl_set_threads(self._ctx, n_threads))
            self.n_threads = n_threads

    def _run(self, call: Callable[[], T]) -> T:
        if self.executor is not None:
            return self.executor(call)
        with self.lock:
            return call()

    def release(self) -> None:
        """Free the kernels' compute buffer (sized to the largest graph run so far); the next kernel
        allocates it again."""
        self._run(lambda: self._lib.kvl_free_buffers(self._ctx))

    def attn_pool(
        self,
        q: np.ndarray,
        k: np.ndarray,
        scale: float | None = None,
        key_mask: np.ndarray | None = None,
        chunk: int = 0,
        pool_kernel: int = 0,
        reduce: str = "sum",
        causal_tail: int = 0,
        k_type: int | None = None,
    ) -> np.ndarray:
        """EchoKV Eq. 3 per layer and KV group (reduce="sum"), or KVzip's score (reduce="max").

        q: [n_layer, n_head, n_q, head_dim] float32 (post-RoPE queries);
        k: [n_layer, n_head_kv, n_keys, head_dim] float32 or float16 (the cached keys to score), or
        uint8 [n_layer, n_head_kv, n_keys, row bytes] of ggml type k_type (a quantized cache's blocks);
        key_mask: bool [n_keys], False for keys outside the softmax (they score 0);
        chunk: keys per chunk (0: one chunk while its logits stay under 8 MB, the fastest; queries go
        in blocks that keep it so, one graph a layer whose blocks reuse one scratch, so the kernel holds
        ~8 MB plus one layer's keys widened; docs/cache.md); pool_kernel: odd max-pool width
        smoothing the pooled scores along the keys (SnapKV; max_smooth, on the host), 0 for none.
        reduce: "sum" (each key's probability summed over the queries of its group) or "max" (its
        largest probability over those queries and query heads);
        causal_tail: the last causal_tail keys are the queries' own keys, in order (n_q of them):
        query r sees tail key j only for j <= r.
        Returns [n_layer, n_head_kv, n_keys] (a query head h reads KV head h // (n_head // n_head_kv)).
        """
        if q.ndim != 4 or k.ndim != 4:
            raise KvliteError(f"attn_pool wants 4-d q and k, got q{q.shape} k{k.shape}")
        n_layer, n_head, n_q, head_dim = q.shape
        if q.dtype != np.float32:
            raise KvliteError(f"attn_pool: q must be float32, got {q.dtype}")
        if k_type is None:
            k_type = {np.dtype(np.float32): GGML_TYPE_F32, np.dtype(np.float16): GGML_TYPE_F16}.get(k.dtype)
            if k_type is None:
                raise KvliteError(f"attn_pool: k must be float32 or float16 (or bytes with k_type), got {k.dtype}")
            row = head_dim
        elif k.dtype != np.uint8:
            raise KvliteError(f"attn_pool: k of ggml type {k_type} must be its bytes (uint8), got {k.dtype}")
        else:
            row = row_bytes(k_type, head_dim)
        if k.shape[0] != n_layer or k.shape[3] != row or n_head % k.shape[1] != 0:
            raise KvliteError(f"attn_pool: q{q.shape} and k{k.shape} do not match (layers, head_dim, GQA)")
        n_head_kv, n_keys = k.shape[1], k.shape[2]
        if n_q == 0 or n_keys == 0:
            raise KvliteError(f"attn_pool: no queries or no keys (q{q.shape} k{k.shape})")
        check_pool_kernel("attn_pool: pool_kernel", pool_kernel)
        if chunk < 0:
            raise KvliteError(f"attn_pool: chunk must be >= 0, got {chunk}")
        if reduce not in ("sum", "max"):
            raise KvliteError(f"attn_pool: reduce must be sum or max, got '{reduce}'")
        if causal_tail and causal_tail != n_q or not 0 <= causal_tail <= n_keys:
            raise KvliteError(f"attn_pool: a causal tail holds the queries' own keys ({n_q}), got {causal_tail}")
        mask = None
        if key_mask is not None:
            key_mask = np.asarray(key_mask, dtype=bool)
            if key_mask.shape != (n_keys,):
                raise KvliteError(f"attn_pool: key_mask has shape {key_mask.shape}, want ({n_keys},)")
            if not key_mask.any():
                raise KvliteError("attn_pool: the key mask hides every key")
            mask = np.where(key_mask, 0.0, MASKED).astype(np.float32)
        q = np.ascontiguousarray(q)
        k = np.ascontiguousarray(k)
        out = np.empty((n_layer, n_head_kv, n_keys), np.float32)
        scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
        rc = self._run(lambda: self._lib.kvl_attn_pool(
            self._ctx, _ptr(q), _ptr(k), k_type, _ptr(mask), n_layer, n_head, n_head_kv, n_q, n_keys, head_dim,
            scale, chunk, int(reduce == "max"), causal_tail, _ptr(out),
        ))  # fmt: skip
        if rc != 0:
            raise KvliteError(f"native attn_pool failed (status {rc}) for q{q.shape} k{k.shape}")
        return max_smooth(out, pool_kernel)

    def to_float(self, ggml_type: int, rows: np.ndarray, n_per_row: int) -> np.ndarray:
        """Rows of a ggml type as llama.cpp stores them (uint8 [n, row bytes]) widened to float32
        [n, n_per_row] by ggml's type traits (a quantized or bf16 cache's rows)."""
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        if rows.ndim != 2:
            raise KvliteError(f"to_float wants rows [n, row bytes], got {rows.shape}")
        out = np.empty((rows.shape[0], n_per_row), np.float32)
        rc = self._lib.kvl_to_float(ggml_type, _ptr(rows), rows.shape[1], _ptr(out), rows.shape[0], n_per_row)
        if rc != 0:
            raise KvliteError(f"to_float: rows{rows.shape} are not rows of {n_per_row} values of ggml type "
                              f"{ggml_type} (status {rc})")  # fmt: skip
        return out

    def rope(self, rope: RopeParams, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate pre-RoPE vectors x [n, heads, head_dim] (float32) to positions [n] as llama.cpp does."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        if x.ndim != 3 or pos.shape != (x.shape[0],):
            raise KvliteError(f"rope wants x [n, heads, head_dim] and n positions, got {x.shape} and {pos.shape}")
        out = np.empty_like(x)
        rope_ref = ctypes.byref(rope)
        rc = self._run(lambda: self._lib.kvl_rope(self._ctx, rope_ref, _ptr(x), _ptr(pos), *x.shape, _ptr(out)))
        if rc != 0:
            raise KvliteError(f"native rope failed (status {rc}) for x{x.shape}")
        return out

    def model_load(self, path: str, hparams: HParams) -> int:
        """Map a GGUF's weights for counter-causal passes; free with model_free."""
        ptr = self._lib.kvl_model_load(str(path).encode(), ctypes.byref(hparams))
        if not ptr:
            raise KvliteError(f"kvlite's native library could not map the weights of {path}")
        return ptr

    def model_free(self, model: int) -> None:
        self._lib.kvl_model_free(model)

    # -- the counter-causal pass, a layer at a time (native/counter_causal.c): cells in DESCENDING position order
    def cc_embed(self, model: int, tokens: np.ndarray, n_embd: int) -> np.ndarray:
        """The token embeddings of tokens int32 [n]: float32 [n, n_embd] (layer 0's input)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        hidden = np.empty((len(tokens), n_embd), np.float32)
        rc = self._run(lambda: self._lib.kvl_cc_embed(self._ctx, model, len(tokens), _ptr(tokens), _ptr(hidden)))
        self._check(rc, "embedding")
        return hidden

    def cc_layer(self, model: int, layer: int, min_gap: int, block_rows: int, positions: np.ndarray, k: np.ndarray,
                 v: np.ndarray, hidden: np.ndarray) -> None:  # fmt: skip
        """One layer over n cells: positions int32 [n]; k, v this layer's cached rows [n, n_embd_kv]
        float16 or float32; hidden float32 [n, n_embd] C-contiguous, replaced by the layer's output."""
        kv_type = {np.dtype(np.float16): GGML_TYPE_F16, np.dtype(np.float32): GGML_TYPE_F32}.get(k.dtype)
        if kv_type is None or v.dtype != k.dtype:
            raise KvliteError(f"counter-causal pass wants float16 or float32 K/V, got {k.dtype} and {v.dtype}")
        if hidden.dtype != np.float32 or not hidden.flags.c_contiguous:
            raise KvliteError("counter-causal hidden rows must be C-contiguous float32")
        positions = np.ascontiguousarray(positions, dtype=np.int32)
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        rc = self._run(lambda: self._lib.kvl_cc_layer(self._ctx, model, layer, min_gap, max(block_rows, 0),
                                                      len(positions), _ptr(positions), _ptr(k), _ptr(v), kv_type,
                                                      _ptr(hidden)))  # fmt: skip
        self._check(rc, f"layer {layer}")

    def cc_output(self, model: int, logprob: bool, block_rows: int, tokens: np.ndarray,
                  hidden: np.ndarray) -> np.ndarray:  # fmt: skip
        """The logit (or log-probability) of tokens[i] from hidden row i: float32 [n]."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        out = np.empty(len(tokens), np.float32)
        rc = self._run(lambda: self._lib.kvl_cc_output(self._ctx, model, int(logprob), max(block_rows, 0), len(tokens),
                                                       _ptr(tokens), _ptr(hidden), _ptr(out)))  # fmt: skip
        self._check(rc, "output")
        return out

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise KvliteError(f"native counter-causal pass failed (status {rc}) at its {what}")

    # -- the eval callback's capture (native/capture.c) -------------------------------------------
    def capture_new(self) -> int:
        return self._lib.kvl_capture_new()

    def capture_free(self, cap: int) -> None:
        self._lib.kvl_capture_free(cap)

    def capture_callback(self) -> int:
        """The address of the C eval callback, for llama_context_params.cb_eval."""
        return ctypes.cast(self._lib.kvl_capture_eval, ctypes.c_void_p).value

    def capture_want(self, cap: int, name: str, op: str) -> int:
        """Ask for the graph nodes named `name` with op `op`; the want's index, or -1 if full."""
        return self._lib.kvl_capture_want(cap, name.encode(), op.encode())

    def capture_enable(self, cap: int, on: bool) -> None:
        self._lib.kvl_capture_enable(cap, int(on))

    def capture_clear(self, cap: int) -> None:
        self._lib.kvl_capture_clear(cap)

    def capture_drop(self, cap: int, want: int) -> None:
        self._lib.kvl_capture_drop(cap, want)

    def capture_records(self, cap: int, only: int | None = None) -> list[tuple[int, np.ndarray]]:
        """Every record since the last clear, or those of want index `only`: (want index, a float32
        copy in ggml's 4-d shape, numpy order). Only the records asked for are copied."""
        n = self._lib.kvl_capture_count(cap)
        if n < 0:
            raise MemoryError("the capture could not store a tensor (out of memory)")
        out = []
        want = ctypes.c_int()
        ne = (ctypes.c_int64 * 4)()
        for i in range(n):
            ptr = self._lib.kvl_capture_record(cap, i, ctypes.byref(want), ne)
            if only is None or want.value == only:
                out.append((want.value, np.ctypeslib.as_array(ptr, shape=tuple(ne)[::-1]).copy()))
        return out

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.kvl_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()


_shared: Native | None = None


def max_smooth(scores: np.ndarray, kernel: int) -> np.ndarray:
    """SnapKV's smoothing along the last axis: each entry takes the largest value within kernel // 2
    entries of it, the window stopping at the ends (max_pool1d with stride 1 and padding kernel // 2;
    exact, as a max is). kernel: odd, or 0 / 1 for none (scores returned as given; limits.check_pool_kernel
    holds callers to it). The one max-pool: attn_pool's pool_kernel and KVzip's smoothing of its pair
    scores (policies/kvzip.py) both apply it."""
    if kernel <= 1:
        return scores
    out = scores.copy()
    for d in range(1, min(kernel // 2, scores.shape[-1] - 1) + 1):  # shifted maxima: faster than a window view
        np.maximum(out[..., d:], scores[..., :-d], out=out[..., d:])
        np.maximum(out[..., :-d], scores[..., d:], out=out[..., :-d])
    return out


def default_threads() -> int:
    """-t's default: the cores this process may run on (taskset, a container's cpuset), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 8))


def devices() -> list[dict]:
    """The devices ggml (llama.cpp's build of it) can use: name, description, type, memory in MiB."""
    lib = _ggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        out.append(dict(name=lib.ggml_backend_dev_name(dev).decode(errors="replace"),
                        description=lib.ggml_backend_dev_description(dev).decode(errors="replace"),
                        type=_DEVICE_TYPES[kind] if kind < len(_DEVICE_TYPES) else str(kind),
                        free_mib=free.value >> 20, total_mib=total.value >> 20))  # fmt: skip
    return out


def default_device() -> str:
    """The first GPU-like device ggml sees (CUDA, Metal, an RPC server), else "cpu"."""
    return next((d["name"] for d in devices() if d["type"] in ("gpu", "igpu")), "cpu")


def rpc_add_servers(servers: str) -> list[str]:
    """--rpc: comma-separated HOST:PORT; the device names they add."""
    return [name for endpoint in servers.split(",") for name in rpc_add_server(endpoint.strip())]


def rpc_add_server(endpoint: str) -> list[str]:
    """Make the devices of a ggml RPC server (llama.cpp's `rpc-server`, or scripts/rpc_server.py)
    visible to llama.cpp, as its --rpc does: -ngl then offloads layers there, and the kernels run
    there by default. Returns their device names. ggml aborts the process when it cannot reach a
    server, so the endpoint is parsed and tried here first."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise KvliteError(f"--rpc wants HOST:PORT, got '{endpoint}'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise KvliteError(f"no RPC server answers at {endpoint} ({e.strerror or e}): start one there first") from None
    ggml = _ggml_rpc()
    reg = ggml.ggml_backend_rpc_add_server(endpoint.encode())
    if not reg:
        raise KvliteError(f"the RPC server at {endpoint} offers no device")
    names = [ggml.ggml_backend_dev_name(ggml.ggml_backend_reg_dev_get(reg, i)).decode()
             for i in range(ggml.ggml_backend_reg_dev_count(reg))]  # fmt: skip
    if not any(endpoint == d["description"] for d in devices()):  # registering twice would list it twice
        ggml.ggml_backend_register(reg)
    # A context reusing its graph asks the server to recompute the one it stored, but the server
    # drops its stored graphs whenever any buffer is freed (another context closing), then refuses
    # the recompute and the client aborts. Contexts made from here on rebuild their graphs instead.
    os.environ["LLAMA_GRAPH_REUSE_DISABLE"] = "1"
    return names


def rpc_serve(endpoint: str, n_threads: int) -> None:
    """Serve this machine's CPU backend to RPC clients at endpoint (blocks; ggml's rpc-server)."""
    ggml = _ggml_rpc()
    cpu = ggml.ggml_backend_dev_by_type(_DEVICE_TYPES.index("cpu"))
    ggml.ggml_backend_rpc_start_server(endpoint.encode(), None, n_threads, 1, (ctypes.c_void_p * 1)(cpu))
    raise KvliteError(f"the RPC server could not start at {endpoint} (see ggml's message above)")


@functools.cache
def _ggml() -> ctypes.CDLL:
    """ggml's own functions, looked up through kvlite's library: its dependencies resolve by soname
    to the copies libllama mapped. (The wheel ships libggml.so and libggml.so.0 as two files, and
    opening one by path can map a second copy, with a device registry llama.cpp never sees.)
    Their prototypes are declared here, once."""
    lib = ctypes.CDLL(str(_find_library()))
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    lib.ggml_backend_dev_count.restype = size
    lib.ggml_backend_dev_get.restype, lib.ggml_backend_dev_get.argtypes = ptr, [size]
    lib.ggml_backend_dev_by_type.restype, lib.ggml_backend_dev_by_type.argtypes = ptr, [ctypes.c_int]
    for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ptr]
    lib.ggml_backend_dev_type.restype, lib.ggml_backend_dev_type.argtypes = ctypes.c_int, [ptr]
    lib.ggml_backend_dev_memory.argtypes = [ptr] + [ctypes.POINTER(size)] * 2
    lib.ggml_backend_reg_dev_count.restype, lib.ggml_backend_reg_dev_count.argtypes = size, [ptr]
    lib.ggml_backend_reg_dev_get.restype, lib.ggml_backend_reg_dev_get.argtypes = ptr, [ptr, size]
    lib.ggml_backend_register.argtypes = [ptr]
    if hasattr(lib, "ggml_backend_rpc_add_server"):  # llama.cpp built with -DGGML_RPC=ON
        lib.ggml_backend_rpc_add_server.restype, lib.ggml_backend_rpc_add_server.argtypes = ptr, [ctypes.c_char_p]
        lib.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, size, size,
                                                      ctypes.POINTER(ptr)]  # fmt: skip
    return lib


def _ggml_rpc() -> ctypes.CDLL:
    lib = _ggml()
    if not hasattr(lib, "ggml_backend_rpc_add_server"):
        raise KvliteError("this llama-cpp-python was built without RPC: reinstall it with CMAKE_ARGS=-DGGML_RPC=ON")
    return lib


def release() -> None:
    """Free the kernels' compute buffer, if the library is loaded (an eviction's end)."""
    if _shared is not None:
        _shared.release()


def native() -> Native:
    """The process-wide instance (one backend, loaded on first use)."""
    global _shared
    if _shared is None:
        _shared = Native()
    return _shared
