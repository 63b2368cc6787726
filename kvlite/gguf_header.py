"""A fast reader of a GGUF file's header: metadata and tensor infos, without the tensor data.

gguf.GGUFReader materialises every array element as a numpy view (5 s for SmolLM2's 49K-token
vocabulary and merges); here arrays of strings are skipped over and only their length kept.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import BinaryIO

from .errors import KvliteError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne)
    ggml_type: int
    offset: int  # relative to the start of the data section


@dataclasses.dataclass
class GGUFHeader:
    metadata: dict  # scalars and strings as values; arrays as lists, or their length if of strings
    tensors: list[TensorInfo]
    data_start: int


class _Cut(Exception):
    pass


def _read(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise _Cut
    return b


def _unpack(f: BinaryIO, fmt: str):
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return _read(f, _unpack(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int):
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, n = _unpack(f, "<I"), _unpack(f, "<Q")
        if etype == _STRING:  # skip, keep the count (vocabularies are long)
            for _ in range(n):
                f.seek(_unpack(f, "<Q"), 1)
            return n
        if etype in _SCALARS:
            size = struct.calcsize(_SCALARS[etype])
            data = _read(f, size * n)
            return list(struct.unpack(f"<{n}{_SCALARS[etype][1:]}", data))
        return [_value(f, etype) for _ in range(n)]
    raise KvliteError(f"unknown GGUF value type {vtype}")


def read_header(path: str) -> GGUFHeader:
    """Raises KvliteError for a file that is not GGUF or ends inside its header."""
    with open(path, "rb") as f:
        try:
            if _read(f, 4) != b"GGUF":
                raise KvliteError(f"{path} is not a GGUF file (bad magic); pass a .gguf model with -m")
            version = _unpack(f, "<I")
            if version not in (2, 3):
                raise KvliteError(f"{path}: unsupported GGUF version {version}")
            n_tensors, n_kv = _unpack(f, "<Q"), _unpack(f, "<Q")
            metadata = {}
            for _ in range(n_kv):
                key = _string(f)
                metadata[key] = _value(f, _unpack(f, "<I"))
            tensors = []
            for _ in range(n_tensors):
                name = _string(f)
                n_dims = _unpack(f, "<I")
                shape = tuple(_unpack(f, "<Q") for _ in range(n_dims))
                tensors.append(TensorInfo(name, shape, _unpack(f, "<I"), _unpack(f, "<Q")))
            align = int(metadata.get("general.alignment", 32))
            pos = f.tell()
            data_start = (pos + align - 1) // align * align
        except _Cut:
            raise KvliteError(f"{path} is truncated: it ends inside the GGUF header") from None
    return GGUFHeader(metadata=metadata, tensors=tensors, data_start=data_start)


def tensor_nbytes(t: TensorInfo) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    except (ValueError, KeyError):
        raise KvliteError(f"tensor {t.name} has an unknown ggml type {t.ggml_type}") from None
    n = 1
    for d in t.shape:
        n *= d
    return n // block * size
