"""A fast reader of a GGUF file's header: metadata and tensor infos, without the tensor data.

gguf.GGUFReader materialises every array element as a numpy view (slow on a large vocabulary and
its merges: docs/design.md, "Measured facts the code relies on"); here arrays of strings are
skipped over and only their length kept.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""

from __future__ import annotations

import dataclasses
import os
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


def shown(value: object, limit: int = 60) -> str:
    """A value read from a file, for a one-line message: repr'd (no raw newline or control
    character), and cut to `limit` characters (a crafted string or array can be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # arrays of arrays: llama.cpp's own files nest none


class _File:
    """Reads a header whose every length is checked against the bytes left, so that no crafted
    count or size allocates, seeks or loops beyond the file: any byte string ends in a KvliteError
    or a header."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def left(self) -> int:
        return self.size - self.f.tell()

    def read(self, n: int) -> bytes:
        if n > self.left():
            raise _Cut
        return self.f.read(n)

    def skip(self, n: int) -> None:
        if n > self.left():
            raise _Cut
        self.f.seek(n, 1)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_DEPTH:
                raise KvliteError(f"GGUF arrays nested more than {MAX_DEPTH} deep")
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype == _STRING:  # skip, keep the count (vocabularies are long)
                if n > self.left() // 8:
                    raise _Cut
                for _ in range(n):
                    self.skip(self.unpack("<Q"))
                return n
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[etype])
                return list(struct.unpack(f"<{n}{_SCALARS[etype][1:]}", self.read(size * n)))
            if etype != _ARRAY:
                raise KvliteError(f"unknown GGUF value type {etype}")
            if n > self.left() // 12:  # an array's type and count alone take 12 bytes
                raise _Cut
            return [self.value(etype, depth + 1) for _ in range(n)]
        raise KvliteError(f"unknown GGUF value type {vtype}")


def read_header(path: str) -> GGUFHeader:
    """Raises KvliteError for a file that is not GGUF, ends inside its header or whose header
    cannot be one (a length past the end, an alignment that is not a power of two, ...)."""
    with open(path, "rb") as f:
        r = _File(f, os.fstat(f.fileno()).st_size)
        try:
            if r.read(4) != b"GGUF":
                raise KvliteError(f"{path} is not a GGUF file (bad magic); pass a .gguf model with -m")
            version = r.unpack("<I")
            if version not in (2, 3):
                raise KvliteError(f"{path}: unsupported GGUF version {version}")
            n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
            metadata = {}
            for _ in range(n_kv):
                key = r.string()
                metadata[key] = r.value(r.unpack("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.unpack("<I")
                if n_dims > MAX_DIMS:
                    raise KvliteError(f"{path}: tensor {shown(name)} has {n_dims} dimensions (ggml has {MAX_DIMS})")
                shape = tuple(r.unpack("<Q") for _ in range(n_dims))
                tensors.append(TensorInfo(name, shape, r.unpack("<I"), r.unpack("<Q")))
            align = metadata.get("general.alignment", 32)
            if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
                raise KvliteError(f"{path}: general.alignment {shown(align)} is not a power of two (gguf.cpp says so)")
            pos = f.tell()
            data_start = (pos + align - 1) // align * align
        except _Cut:
            raise KvliteError(f"{path} is truncated: it ends inside the GGUF header") from None
        except KvliteError as e:
            raise KvliteError(str(e) if str(path) in str(e) else f"{path}: {e}") from None
    return GGUFHeader(metadata=metadata, tensors=tensors, data_start=data_start)


def row_bytes(ggml_type: int, n: int) -> int:
    """Bytes of n values of a ggml type (n a multiple of its block): ggml_row_size."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise KvliteError(f"unknown ggml type {ggml_type}") from None
    return n // block * size


def tensor_nbytes(t: TensorInfo) -> int:
    n = 1
    for d in t.shape:
        n *= d
    try:
        return row_bytes(t.ggml_type, n)
    except KvliteError:
        raise KvliteError(f"tensor {shown(t.name)} has an unknown ggml type {t.ggml_type}") from None
