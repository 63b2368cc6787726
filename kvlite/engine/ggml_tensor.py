"""A ctypes mirror of `struct ggml_tensor` (ggml as shipped in llama-cpp-python 0.3.36) and a copy
of a tensor's data into numpy. kvlite's native library reports sizeof(struct ggml_tensor) as
compiled against the installed headers; tests hold this mirror to it."""

from __future__ import annotations

import ctypes
import pathlib

import llama_cpp
import numpy as np

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64


class GgmlTensor(ctypes.Structure):
    pass


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


def _load_ggml_base() -> ctypes.CDLL:
    # Open the soname that libllama already mapped: opening lib/libggml-base.so by path would map
    # a second, independent copy of ggml.
    try:
        lib = ctypes.CDLL("libggml-base.so.0")
    except OSError:
        lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so.0"))
    lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
    lib.ggml_op_desc.restype = ctypes.c_char_p
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    lib.ggml_backend_tensor_get.restype = None
    return lib


ggml = _load_ggml_base()

_DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.float16)}


def op_name(tensor_ptr: int) -> str:
    return ggml.ggml_op_desc(tensor_ptr).decode()


def tensor_to_numpy(tensor_ptr: int) -> np.ndarray:
    """Copy a f32/f16 tensor, contiguous or a strided view, into a float32 array of shape ne[::-1]."""
    t = ctypes.cast(tensor_ptr, ctypes.POINTER(GgmlTensor)).contents
    dtype = _DTYPES.get(t.type)
    if dtype is None:
        raise TypeError(f"cannot capture ggml tensor {t.name!r} of type {t.type}")
    ne = [t.ne[i] for i in range(GGML_MAX_DIMS)]
    nb = [t.nb[i] for i in range(GGML_MAX_DIMS)]
    extent = sum((n - 1) * b for n, b in zip(ne, nb)) + dtype.itemsize
    raw = np.empty(extent, dtype=np.uint8)
    # Works for host and device buffers alike; offsets are relative to the view itself.
    ggml.ggml_backend_tensor_get(tensor_ptr, raw.ctypes.data, 0, extent)
    view = np.ndarray(shape=ne[::-1], dtype=dtype, buffer=raw.data, strides=nb[::-1])
    return view.astype(np.float32)
