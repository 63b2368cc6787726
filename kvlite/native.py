"""ctypes binding of native/kvlite_native.c, the ggml score kernels.

The library is built by `pip install .` (scikit-build-core) against the ggml that llama-cpp-python
installs. A missing or stale build is an error: there is no slower fallback.
"""

from __future__ import annotations

import ctypes
import pathlib

import llama_cpp  # noqa: F401  -- maps libggml* first, so the kernels share llama.cpp's ggml
import numpy as np

from .errors import KvliteError

ABI_VERSION = 7
_LIB_NAME = "libkvlite_native.so"
_REBUILD = "reinstall kvlite (pip install .) to rebuild it"

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
MASKED = -1e30  # additive logit of a key outside the softmax: exp underflows to exactly 0, no inf - inf


class HParams(ctypes.Structure):
    """Mirror of struct kvl_hparams (native/counter_causal.c)."""

    _fields_ = [(name, ctypes.c_int32) for name in ("arch", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim")]
    _fields_ += [("n_vocab", ctypes.c_int32), ("rms_eps", ctypes.c_float)]
    _fields_ += [(name, ctypes.c_int32) for name in ("rope_mode", "rope_dims", "rope_n_ctx_orig")]
    _fields_ += [
        (name, ctypes.c_float)
        for name in ("rope_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast")
    ]
    _fields_ += [("yarn_beta_slow", ctypes.c_float)]


def _find_library() -> pathlib.Path:
    # Installed next to this file; an editable/source checkout may hold it in build/.
    here = pathlib.Path(__file__).resolve().parent
    candidates = [here / _LIB_NAME, *sorted(here.parent.glob(f"build/*/{_LIB_NAME}"))]
    for path in candidates:
        if path.exists():
            return path
    raise KvliteError(f"kvlite's native library ({_LIB_NAME}) is missing: {_REBUILD}")


class Native:
    """The loaded library and one ggml CPU backend reused across calls."""

    def __init__(self, n_threads: int = 2, path: str | pathlib.Path | None = None):
        self._ctx = None
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
        lib.kvl_init.argtypes = [ctypes.c_int]
        lib.kvl_free.argtypes = [ctypes.c_void_p]
        lib.kvl_attn_pool.restype = ctypes.c_int
        lib.kvl_attn_pool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kvl_attn_pool.argtypes += [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.kvl_rope.restype = ctypes.c_int
        lib.kvl_rope.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 6
        lib.kvl_rope.argtypes += [ctypes.c_float] * 6 + [ctypes.c_void_p]
        lib.kvl_model_load.restype = ctypes.c_void_p
        lib.kvl_model_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(HParams)]
        lib.kvl_model_free.argtypes = [ctypes.c_void_p]
        lib.kvl_counter_causal.restype = ctypes.c_int
        lib.kvl_counter_causal.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 5
        lib.kvl_counter_causal.argtypes += [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.kvl_capture_new.restype = ctypes.c_void_p
        for fn in (lib.kvl_capture_free, lib.kvl_capture_clear):
            fn.argtypes = [ctypes.c_void_p]
        lib.kvl_capture_drop.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.kvl_capture_want.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        lib.kvl_capture_enable.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.kvl_capture_count.argtypes = [ctypes.c_void_p]
        lib.kvl_capture_record.restype = ctypes.POINTER(ctypes.c_float)
        lib.kvl_capture_record.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                           ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
        self._lib = lib
        self._ctx = lib.kvl_init(n_threads)
        if not self._ctx:
            raise KvliteError("kvlite's native library could not start a ggml CPU backend")
        self.path = path

    @property
    def lib(self) -> ctypes.CDLL:
        return self._lib

    @property
    def ctx(self) -> int:
        """The native context (one ggml backend) the kernels run on."""
        return self._ctx

    def attn_pool(
        self,
        q: np.ndarray,
        k: np.ndarray,
        scale: float | None = None,
        key_mask: np.ndarray | None = None,
        chunk: int = 0,
        pool_kernel: int = 0,
    ) -> np.ndarray:
        """EchoKV Eq. 3 per layer and KV group.

        q: [n_layer, n_head, n_q, head_dim] float32 (post-RoPE queries);
        k: [n_layer, n_head_kv, n_keys, head_dim] float32 or float16 (the cached keys to score);
        key_mask: bool [n_keys], False for keys outside the softmax (they score 0);
        chunk: keys per chunk (0: one chunk per layer while its logits stay under 64 MB, the
        fastest: 16K keys ran ~2x faster in one chunk than in chunks of 4K); pool_kernel: odd max-pool width
        smoothing the pooled scores along the keys (SnapKV), 0 for none.
        Returns [n_layer, n_head_kv, n_keys]: each key's softmax probability summed over the
        queries of its group (a query head h reads KV head h // (n_head // n_head_kv)).
        """
        if q.ndim != 4 or k.ndim != 4:
            raise KvliteError(f"attn_pool wants 4-d q and k, got q{q.shape} k{k.shape}")
        n_layer, n_head, n_q, head_dim = q.shape
        if k.shape[0] != n_layer or k.shape[3] != head_dim or n_head % k.shape[1] != 0:
            raise KvliteError(f"attn_pool: q{q.shape} and k{k.shape} do not match (layers, head_dim, GQA)")
        if q.dtype != np.float32:
            raise KvliteError(f"attn_pool: q must be float32, got {q.dtype}")
        k_type = {np.dtype(np.float32): GGML_TYPE_F32, np.dtype(np.float16): GGML_TYPE_F16}.get(k.dtype)
        if k_type is None:
            raise KvliteError(f"attn_pool: k must be float32 or float16, got {k.dtype}")
        n_head_kv, n_keys = k.shape[1], k.shape[2]
        if n_q == 0 or n_keys == 0:
            raise KvliteError(f"attn_pool: no queries or no keys (q{q.shape} k{k.shape})")
        if pool_kernel < 0 or (pool_kernel > 1 and pool_kernel % 2 == 0):
            raise KvliteError(f"attn_pool: the pooling kernel must be odd, got {pool_kernel}")
        if chunk < 0:
            raise KvliteError(f"attn_pool: chunk must be >= 0, got {chunk}")
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
        rc = self._lib.kvl_attn_pool(
            self._ctx, q.ctypes.data, k.ctypes.data, k_type, None if mask is None else mask.ctypes.data,
            n_layer, n_head, n_head_kv, n_q, n_keys, head_dim, scale, chunk, pool_kernel, out.ctypes.data,
        )  # fmt: skip
        if rc != 0:
            raise KvliteError(f"native attn_pool failed (status {rc}) for q{q.shape} k{k.shape}")
        return out

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.kvl_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()


_shared: Native | None = None


def native() -> Native:
    """The process-wide instance (one backend, loaded on first use)."""
    global _shared
    if _shared is None:
        _shared = Native()
    return _shared
