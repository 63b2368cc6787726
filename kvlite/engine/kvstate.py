"""Parse and rebuild the per-sequence K/V blob of `llama_state_seq_get_data`.

Layout (llama-cpp-python 0.3.36, a plain KV cache, no per-cell extension, little endian):
    u32 magic 0xaf143cd8 ; i32 seq_id ; u32 n_stream
    per stream: u32 cell_count (0: nothing else for this stream)
      cell_count x { i32 pos ; u32 n_seq_id ; n_seq_id x i32 seq_id }
      u32 v_trans ; u32 n_layer
      n_layer x { i32 k_type ; u64 k_row_bytes ; cell_count rows }
      v_trans=0: n_layer x { i32 v_type ; u64 v_row_bytes ; cell_count rows }
      v_trans=1: n_layer x { i32 v_type ; u32 el_bytes ; u32 n_embd_v ; n_embd_v x (cell_count x el) }
Cells come in cell-index order; a sequence's evicted cells are simply absent.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from ..errors import KvliteError

MAGIC = 0xAF143CD8
_NUMPY = {0: np.dtype(np.float32), 1: np.dtype(np.float16)}


@dataclasses.dataclass
class Stream:
    """The cells of one sequence in one KV stream: K rows [cells, n_embd_k] and V rows
    [cells, n_embd_v] per layer (V stored transposed when v_trans)."""

    pos: np.ndarray  # int32 [cells]
    seq_ids: list[list[int]]
    v_trans: int = 0
    k_types: list[tuple] = dataclasses.field(default_factory=list)
    v_types: list[tuple] = dataclasses.field(default_factory=list)
    k: list[np.ndarray] = dataclasses.field(default_factory=list)
    v: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def cell_count(self) -> int:
        return len(self.pos)

    def take(self, idx: np.ndarray) -> Stream:
        """The same stream restricted to cells `idx`, in that order."""
        idx = np.asarray(idx, dtype=np.int64)
        return Stream(
            pos=self.pos[idx],
            seq_ids=[self.seq_ids[i] for i in idx],
            v_trans=self.v_trans,
            k_types=self.k_types,
            v_types=self.v_types,
            k=[a[idx] for a in self.k],
            v=[a[idx] for a in self.v],
        )


@dataclasses.dataclass
class SeqState:
    seq_id: int
    streams: list[Stream | None]  # None: the sequence has no cell in that stream

    def positions(self) -> np.ndarray:
        """Every resident position of the sequence, sorted."""
        parts = [s.pos for s in self.streams if s is not None]
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, np.int32)


class _Reader:
    def __init__(self, blob: bytes):
        self.b = memoryview(blob)
        self.o = 0

    def unpack(self, fmt: str):
        vals = struct.unpack_from(fmt, self.b, self.o)
        self.o += struct.calcsize(fmt)
        return vals if len(vals) > 1 else vals[0]

    def array(self, n_bytes: int, dtype: np.dtype | None) -> np.ndarray:
        if self.o + n_bytes > len(self.b):
            raise KvliteError("KV state blob is shorter than its header says")
        a = np.frombuffer(self.b[self.o : self.o + n_bytes], dtype=np.uint8)
        self.o += n_bytes
        return a.view(dtype) if dtype is not None else a


def parse(blob: bytes) -> SeqState:
    r = _Reader(blob)
    magic, seq_id, n_stream = r.unpack("<IiI")
    if magic != MAGIC:
        raise KvliteError(f"unknown KV state format (magic {magic:#x}): kvlite needs llama-cpp-python 0.3.36")
    streams: list[Stream | None] = []
    for _ in range(n_stream):
        cells = r.unpack("<I")
        if cells == 0:
            streams.append(None)
            continue
        pos = np.empty(cells, np.int32)
        seq_ids = []
        for i in range(cells):
            pos[i], n_seq = r.unpack("<iI")
            seq_ids.append([r.unpack("<i") for _ in range(n_seq)])
        st = Stream(pos=pos, seq_ids=seq_ids)
        st.v_trans, n_layer = r.unpack("<II")
        for _ in range(n_layer):
            k_type, row = r.unpack("<iQ")
            st.k_types.append((k_type, row))
            st.k.append(_rows(r, cells, row, k_type))
        for _ in range(n_layer):
            v_type = r.unpack("<i")
            if not st.v_trans:
                row = r.unpack("<Q")
                st.v_types.append((v_type, row))
                st.v.append(_rows(r, cells, row, v_type))
            else:
                el, n_embd = r.unpack("<II")
                st.v_types.append((v_type, el, n_embd))
                st.v.append(r.array(n_embd * cells * el, _NUMPY.get(v_type)).reshape(n_embd, cells).T)
        streams.append(st)
    if r.o != len(blob):
        raise KvliteError(f"KV state blob has {len(blob) - r.o} unexpected trailing bytes")
    return SeqState(seq_id=seq_id, streams=streams)


def _rows(r: _Reader, cells: int, row_bytes: int, ggml_type: int) -> np.ndarray:
    dtype = _NUMPY.get(ggml_type)
    a = r.array(cells * row_bytes, None)
    return a.view(dtype).reshape(cells, -1) if dtype is not None else a.reshape(cells, row_bytes)


def build(state: SeqState) -> bytes:
    """The inverse of parse."""
    parts = [struct.pack("<IiI", MAGIC, state.seq_id, len(state.streams))]
    for st in state.streams:
        if st is None or st.cell_count == 0:
            parts.append(struct.pack("<I", 0))
            continue
        parts.append(struct.pack("<I", st.cell_count))
        for p, ids in zip(st.pos, st.seq_ids):
            parts.append(struct.pack(f"<iI{len(ids)}i", int(p), len(ids), *ids))
        parts.append(struct.pack("<II", st.v_trans, len(st.k)))
        for (k_type, row), k in zip(st.k_types, st.k):
            parts.append(struct.pack("<iQ", k_type, row) + np.ascontiguousarray(k).tobytes())
        for vt, v in zip(st.v_types, st.v):
            if not st.v_trans:
                parts.append(struct.pack("<iQ", *vt) + np.ascontiguousarray(v).tobytes())
            else:
                parts.append(struct.pack("<iII", *vt) + np.ascontiguousarray(v.T).tobytes())
    return b"".join(parts)
