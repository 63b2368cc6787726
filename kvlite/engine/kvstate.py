"""Parse and rebuild the per-sequence K/V blob of `llama_state_seq_get_data`.

Layout (llama-cpp-python 0.3.36, KV caches with no per-cell extension, little endian):
    u32 magic 0xaf143cd8 ; i32 seq_id ; then one section per KV cache of the model: one for a plain
    cache; two for interleaved sliding-window attention (llama_kv_cache_iswa::state_write: the
    global layers' cache, which holds every cell of the sequence, then the sliding layers', which
    holds only the cells inside the window). A section:
    u32 n_stream
    per stream: u32 cell_count (0: nothing else for this stream)
      cell_count x { i32 pos ; u32 n_seq_id ; n_seq_id x i32 seq_id }
      u32 v_trans ; u32 n_layer
      n_layer x { i32 k_type ; u64 k_row_bytes ; cell_count rows }
      v_trans=0: n_layer x { i32 v_type ; u64 v_row_bytes ; cell_count rows }
      v_trans=1: n_layer x { i32 v_type ; u32 el_bytes ; u32 n_embd_v ; n_embd_v x (cell_count x el) }
Cells come in cell-index order; a sequence's evicted cells are simply absent. A section's layers
are its cache's, in model order (section 0 of gemma3: its global layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from ..errors import KvliteError

MAGIC = 0xAF143CD8
# the types numpy can hold as elements (bf16 as its bits), so a transposed V reads back as rows;
# a quantized type's rows are its bytes [cells, row bytes] (blocks: never transposed, see _view)
_NUMPY = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 30: np.dtype(np.uint16)}


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


@dataclasses.dataclass
class SeqState:
    seq_id: int
    streams: list[Stream | None]  # section 0's streams; None: the sequence has no cell in that stream
    more: list[list[Stream | None]] = dataclasses.field(default_factory=list)  # the sections after it

    @property
    def sections(self) -> list[list[Stream | None]]:
        return [self.streams, *self.more]

    def positions(self) -> np.ndarray:
        """Every resident position of the sequence, sorted (section 0 holds all of them)."""
        parts = [s.pos for s in self.streams if s is not None]
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, np.int32)


class _Reader:
    """Reads the blob in memory."""

    def __init__(self, blob: bytes):
        self.b = memoryview(blob)
        self.o = 0

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.o + n > len(self.b):
            raise KvliteError("KV state blob is shorter than its header says")
        vals = struct.unpack_from(fmt, self.b, self.o)
        self.o += n
        return vals if len(vals) > 1 else vals[0]

    def skip(self, n_bytes: int) -> int:
        """Step over n_bytes of tensor data; returns where they start."""
        if self.o + n_bytes > len(self.b):
            raise KvliteError("KV state blob is shorter than its header says")
        self.o += n_bytes
        return self.o - n_bytes

    def at_end(self) -> bool:
        return self.o == len(self.b)


class _FileReader(_Reader):
    """Reads a state file: small fields through the buffered file, tensor data skipped by seeking."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        raw = self.f.read(n)
        if len(raw) != n:
            raise KvliteError("KV state file is shorter than its header says")
        vals = struct.unpack(fmt, raw)
        return vals if len(vals) > 1 else vals[0]

    def skip(self, n_bytes: int) -> int:
        o = self.f.tell()
        if o + n_bytes > self.size:
            raise KvliteError("KV state file is shorter than its header says")
        self.f.seek(n_bytes, 1)
        return o

    def at_end(self) -> bool:
        return self.f.tell() == self.size


@dataclasses.dataclass
class _Layout:
    """Where one stream's cells and tensors lie: k_at/v_at are the byte offsets of each layer's data."""

    pos: np.ndarray
    seq_ids: list[list[int]]
    v_trans: int = 0
    k_types: list[tuple] = dataclasses.field(default_factory=list)
    v_types: list[tuple] = dataclasses.field(default_factory=list)
    k_at: list[int] = dataclasses.field(default_factory=list)
    v_at: list[int] = dataclasses.field(default_factory=list)


def _walk(r: _Reader) -> list[list[_Layout | None]]:
    """The layout of every stream of every section, from the first n_stream on (the one parser of
    the format)."""
    sections = []
    while True:
        sections.append(_walk_section(r))
        if r.at_end():
            return sections


def _walk_section(r: _Reader) -> list[_Layout | None]:
    streams: list[_Layout | None] = []
    for _ in range(r.unpack("<I")):
        cells = r.unpack("<I")
        if cells == 0:
            streams.append(None)
            continue
        pos = np.empty(cells, np.int32)
        seq_ids = []
        for i in range(cells):
            pos[i], n_seq = r.unpack("<iI")
            seq_ids.append([r.unpack("<i") for _ in range(n_seq)])
        lay = _Layout(pos=pos, seq_ids=seq_ids)
        lay.v_trans, n_layer = r.unpack("<II")
        for _ in range(n_layer):
            lay.k_types.append(r.unpack("<iQ"))  # (ggml type, row bytes)
            lay.k_at.append(r.skip(_nbytes(cells, lay.k_types[-1])))
        for _ in range(n_layer):
            v_type = r.unpack("<i")
            # (ggml type, row bytes), or transposed: (ggml type, element bytes, n_embd)
            lay.v_types.append((v_type, *r.unpack("<II")) if lay.v_trans else (v_type, r.unpack("<Q")))
            lay.v_at.append(r.skip(_nbytes(cells, lay.v_types[-1], lay.v_trans)))
        streams.append(lay)
    return streams


def _nbytes(cells: int, desc: tuple, v_trans: int = 0) -> int:
    """Bytes of one layer's data for `cells` cells (desc: its k_types or v_types entry)."""
    return cells * desc[1] * (desc[2] if v_trans else 1)


def _view(raw: np.ndarray, cells: int, desc: tuple, v_trans: int = 0) -> np.ndarray:
    """Typed rows [cells, n] of one layer's bytes (V stored transposed when v_trans)."""
    dtype = _NUMPY.get(desc[0])
    if v_trans and dtype is None:  # llama.cpp needs flash attention, and so V rows, for these
        raise KvliteError(f"a transposed V cache of ggml type {desc[0]} cannot be read")
    if v_trans:
        return raw.view(dtype).reshape(desc[2], cells).T
    return raw.view(dtype).reshape(cells, -1) if dtype is not None else raw.reshape(cells, desc[1])


def parse(blob: bytes) -> SeqState:
    r = _Reader(blob)
    magic, seq_id = r.unpack("<Ii")
    if magic != MAGIC:
        raise KvliteError(f"unknown KV state format (magic {magic:#x}): kvlite needs llama-cpp-python 0.3.36")
    data = np.frombuffer(blob, dtype=np.uint8)
    sections = []
    for layouts in _walk(r):
        streams: list[Stream | None] = []
        for lay in layouts:
            if lay is None:
                streams.append(None)
                continue
            n, vt = len(lay.pos), lay.v_trans
            st = Stream(pos=lay.pos, seq_ids=lay.seq_ids, v_trans=vt, k_types=lay.k_types, v_types=lay.v_types)
            st.k = [_view(data[o : o + _nbytes(n, t)], n, t) for o, t in zip(lay.k_at, lay.k_types)]
            st.v = [_view(data[o : o + _nbytes(n, t, vt)], n, t, vt) for o, t in zip(lay.v_at, lay.v_types)]
            streams.append(st)
        sections.append(streams)
    return SeqState(seq_id=seq_id, streams=sections[0], more=sections[1:])


FILE_MAGIC, FILE_VERSION = 0x67677371, 3  # "ggsq": llama_state_seq_save_file's header


class StateFile:
    """One sequence's state as `llama_state_seq_save_file` wrote it, read a layer at a time.

    The file is the blob of `llama_state_seq_get_data` from n_stream on, after a header (magic,
    version, token count, tokens). llama.cpp writes it one tensor range at a time, so neither side
    ever holds the whole export in memory (at 8K tokens on SmolLM2 the blob is ~190 MB: the largest
    part of an eviction's memory peak when it was read from memory). Only the kv_unified case of one
    stream per section is read. k(il) and v(il) read section 0 (every cell of the sequence); il
    counts that section's layers."""

    def __init__(self, path: str | os.PathLike):
        self.f = open(path, "rb")  # noqa: SIM115 (held until close)
        try:
            size = os.fstat(self.f.fileno()).st_size
            r = _FileReader(self.f, size)
            magic, version, n_tokens = r.unpack("<III")
            if magic != FILE_MAGIC or version != FILE_VERSION:
                raise KvliteError(f"not a llama-cpp-python 0.3.36 state file (magic {magic:#x}, version {version})")
            r.skip(4 * n_tokens)
            self.sections: list[_Layout | None] = []  # None: the sequence has no cell in that cache
            for streams in _walk(r):
                if len(streams) != 1:
                    raise KvliteError(f"reading a state file expects one KV stream, found {len(streams)}")
                self.sections.append(streams[0])
            if self.sections[0] is None:
                raise KvliteError("the state file holds no cell of the sequence")
        except BaseException:
            self.f.close()
            raise
        self.layout = self.sections[0]
        self.pos = self.layout.pos
        self.n_layer = len(self.layout.k_at)
        self.by_position = np.argsort(self.pos, kind="stable")  # cells in position order

    def k(self, il: int, order: np.ndarray | None = None) -> np.ndarray:
        """Layer il's K rows [cells, n_embd_k], in cell order or in `order`."""
        return self._read(self.layout.k_at[il], self.layout.k_types[il], order)

    def v(self, il: int, order: np.ndarray | None = None) -> np.ndarray:
        """Layer il's V rows [cells, n_embd_v] (transposed back when llama.cpp stores V transposed)."""
        return self._read(self.layout.v_at[il], self.layout.v_types[il], order, self.layout.v_trans)

    def state(self, seq_id: int, by_position: bool = False, positions: np.ndarray | None = None) -> SeqState:
        """Every section (each one's cells in position order if by_position; only those at
        `positions` if given), e.g. to load it back with `build` or `write`. Its layers are read
        from the file when used, one at a time, so only while the file is open (or `held`)."""
        sections = []
        for lay in self.sections:
            if lay is None:
                sections.append([None])
                continue
            idx = np.argsort(lay.pos, kind="stable") if by_position else np.arange(len(lay.pos))
            if positions is not None:
                idx = idx[np.isin(lay.pos[idx], positions)]
                if not len(idx):
                    sections.append([None])
                    continue
            n = len(lay.pos)
            k = self._layers(lay.k_at, lay.k_types, idx, n)
            v = self._layers(lay.v_at, lay.v_types, idx, n, lay.v_trans)
            sections.append([Stream(pos=lay.pos[idx], seq_ids=[lay.seq_ids[i] for i in idx], v_trans=lay.v_trans,
                                    k_types=lay.k_types, v_types=lay.v_types, k=k, v=v)])  # fmt: skip
        return SeqState(seq_id, sections[0], sections[1:])

    def _layers(self, offsets: list[int], types: list[tuple], idx: np.ndarray, n: int, v_trans: int = 0) -> _Layers:
        """One stream's K (or V) layers of n cells, each read from the file when asked for, the
        cells at idx in that order."""
        return _Layers(lambda j: self._read(offsets[j], types[j], idx, v_trans, n), len(offsets))

    def _read(self, offset: int, desc: tuple, order: np.ndarray | None, v_trans: int = 0, n: int | None = None):
        n = len(self.pos) if n is None else n
        raw = np.empty(_nbytes(n, desc, v_trans), np.uint8)
        self.f.seek(offset)
        if self.f.readinto(memoryview(raw)) != len(raw):
            raise KvliteError("KV state file is shorter than its header says")
        rows = _view(raw, n, desc, v_trans)
        return rows if order is None else rows[order]

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> StateFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Layers:
    """A stream's per-layer rows, read when asked for (StateFile.state): a list's interface."""

    def __init__(self, read, n: int):
        self.read, self.n = read, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> np.ndarray:
        if not 0 <= j < self.n:
            raise IndexError(j)
        return self.read(j)

    def __iter__(self):
        return (self.read(j) for j in range(self.n))


def held(state: SeqState) -> SeqState | None:
    """The state with every layer read into memory: it outlives the file it came from."""
    return select(state, lambda _, pos: np.ones(len(pos), bool))


def merge(a: SeqState | None, b: SeqState) -> SeqState:
    """The cells of two states of one sequence in one context (the same types and layers), at
    disjoint positions, each section in position order. Layers are joined when read, one at a
    time, as StateFile.state reads them."""
    if a is None:
        return b
    sections = []
    for sa, sb in zip(a.sections, b.sections, strict=True):
        x, y = sa[0], sb[0]
        if x is None or y is None:
            sections.append([y if x is None else x])
            continue
        if (x.v_trans, x.k_types, x.v_types) != (y.v_trans, y.k_types, y.v_types):
            raise KvliteError("cannot merge KV states of different cache types or layouts")
        pos = np.concatenate([x.pos, y.pos])
        if len(np.unique(pos)) != len(pos):
            raise KvliteError("cannot merge KV states that hold the same position twice")
        order = np.argsort(pos, kind="stable")
        ids = x.seq_ids + y.seq_ids
        k, v = _joined(x.k, y.k, order), _joined(x.v, y.v, order)
        sections.append([Stream(pos=pos[order], seq_ids=[ids[i] for i in order], v_trans=x.v_trans,
                                k_types=x.k_types, v_types=x.v_types, k=k, v=v)])  # fmt: skip
    return SeqState(b.seq_id, sections[0], sections[1:])


def _joined(xs, ys, order: np.ndarray) -> _Layers:
    return _Layers(lambda j: np.concatenate([xs[j], ys[j]])[order], len(xs))


def select(state: SeqState, keep: Callable[[int, np.ndarray], np.ndarray], lazy: bool = False) -> SeqState | None:
    """The cells of each section for which keep(section, positions) is True, held in memory (None:
    no cell left in section 0); lazy: each layer's rows read when asked for, as merge joins them."""

    def rows(layers, idx: np.ndarray):
        if lazy:
            return _Layers(lambda j: np.asarray(layers[j])[idx], len(layers))
        return [np.array(a)[idx] for a in layers]

    def part(i: int, st: Stream) -> Stream | None:
        idx = np.flatnonzero(keep(i, st.pos))
        if not len(idx):
            return None
        return dataclasses.replace(st, pos=st.pos[idx], seq_ids=[st.seq_ids[j] for j in idx],
                                   k=rows(st.k, idx), v=rows(st.v, idx))  # fmt: skip

    sections = [[None if s[0] is None else part(i, s[0])] for i, s in enumerate(state.sections)]
    return None if sections[0][0] is None else SeqState(state.seq_id, sections[0], sections[1:])


def mapped(state: SeqState, path: str | os.PathLike) -> SeqState:
    """The state's rows written to a file a layer at a time (what merge and a lazy select join is
    read one layer at a time) and mapped back read-only: the rows then live in the OS's file cache,
    which it can page out, not in the process's heap. The file is removed once mapped where the
    OS allows (POSIX): the mapping holds it until the last view of it goes."""
    layout, offset = [], 0
    try:
        with open(path, "wb") as f:
            for streams in state.sections:
                for st in streams:
                    for rows in (*st.k, *st.v) if st else ():
                        a = np.ascontiguousarray(rows)
                        layout.append((offset, a.dtype, a.shape))
                        a.tofile(f)
                        pad = -a.nbytes % 64  # each array at an aligned offset
                        f.write(b"\0" * pad)
                        offset += a.nbytes + pad
        buf = np.memmap(path, np.uint8, "r") if offset else np.zeros(0, np.uint8)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise KvliteError(f"cannot write evicted cells to {path}: {e.strerror or e} (free disk space there, or "
                          "give --recall-store more memory)") from None  # fmt: skip
    with contextlib.suppress(OSError):
        os.unlink(path)
    views = iter([buf[o : o + dt.itemsize * int(np.prod(shape))].view(dt).reshape(shape) for o, dt, shape in layout])

    def part(st: Stream | None) -> Stream | None:
        if st is None:
            return None
        k = [next(views) for _ in st.k]
        return dataclasses.replace(st, pos=st.pos.copy(), seq_ids=list(st.seq_ids), k=k, v=[next(views) for _ in st.v])

    sections = [[part(st) for st in streams] for streams in state.sections]
    return SeqState(state.seq_id, sections[0], sections[1:])


def nbytes(state: SeqState | None) -> int:
    """Host bytes of a held state's rows."""
    if state is None:
        return 0
    return sum(sum(a.nbytes for a in (*st.k, *st.v)) + st.pos.nbytes for s in state.sections for st in s if st)


def build(state: SeqState) -> bytes:
    """The inverse of parse."""
    return b"".join([struct.pack("<Ii", MAGIC, state.seq_id), *_sections(state)])


def write(state: SeqState, path: str | os.PathLike) -> None:
    """The state as `llama_state_seq_save_file` writes it (with no tokens), for
    `llama_state_seq_load_file`: written and loaded a layer at a time, where `build` and
    `llama_state_seq_set_data` hold the whole blob (several copies of it, in Python)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<III", FILE_MAGIC, FILE_VERSION, 0))
        for part in _sections(state):
            f.write(part)


def _sections(state: SeqState):
    for streams in state.sections:
        yield struct.pack("<I", len(streams))
        yield from _build_streams(streams)


def _build_streams(streams: list[Stream | None]):
    for st in streams:
        if st is None or st.cell_count == 0:
            yield struct.pack("<I", 0)
            continue
        yield struct.pack("<I", st.cell_count)
        yield b"".join(struct.pack(f"<iI{len(ids)}i", int(p), len(ids), *ids) for p, ids in zip(st.pos, st.seq_ids))
        yield struct.pack("<II", st.v_trans, len(st.k))
        for (k_type, row), k in zip(st.k_types, st.k):
            yield struct.pack("<iQ", k_type, row)
            yield np.ascontiguousarray(k).tobytes()
        for vt, v in zip(st.v_types, st.v):
            yield struct.pack("<iII" if st.v_trans else "<iQ", *vt)
            yield np.ascontiguousarray(v.T if st.v_trans else v).tobytes()
