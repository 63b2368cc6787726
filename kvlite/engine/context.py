"""One llama.cpp context: batched decode at explicit positions and sequence ids, logits, the
sequence (memory) operations and the per-sequence state export/import."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence

import llama_cpp as L
import numpy as np

from ..errors import KvliteError
from ..limits import DEFAULT_CHUNK
from ..native import default_threads, native
from . import cachetypes, kvstate
from .batcher import Batcher, Job, decode_failed, fill_batch
from .capture import Capture, PoolCapture
from .model import LOG_BUFFERS, LOG_ERRORS, Model, logged_buffers
from .sampling import Sampler

MAX_LANES = 128  # llama.cpp's LLAMA_MAX_SEQ (256) sequences, two a cache

# A cache's two sequences (KVCache): the live cache and the lookahead workspace view. A context of
# one cache uses these ids; a pool of several gives cache i the ids 2i and 2i + 1 (lane_seqs).
LIVE, WORKSPACE = 0, 1


def lane_seqs(lane: int) -> tuple[int, int]:
    """The (live, workspace) sequence ids of a pool's lane `lane`."""
    return 2 * lane, 2 * lane + 1


_NOTED: set[str] = set()


@contextlib.contextmanager
def _temp_path():
    """A new file's path in TMPDIR, removed on leaving (an open file keeps its data until closed)."""
    fd, path = tempfile.mkstemp(prefix="kvlite-state-", suffix=".bin")
    os.close(fd)
    try:
        yield path
    finally:
        os.unlink(path)


def _check_room(model: Model, n_ctx: int, layer_cell_bytes: int, swa_full: bool, type_k: str, type_v: str) -> None:
    """Refuse, before llama.cpp allocates, a KV cache larger than the memory free where it would
    live (the machine's, or the GPU's when layers are offloaded), naming both figures."""
    info = model.info
    sliding = len(info.swa_layers) * (n_ctx if swa_full else min(n_ctx, info.n_swa + 512))
    need = (len(info.full_layers) * n_ctx + sliding) * layer_cell_bytes
    where, free = _free_memory(model)
    if free is not None and need > free:
        raise KvliteError(f"a {n_ctx}-cell context needs {need >> 20} MiB of KV cache (-ctk {type_k} -ctv "
                          f"{type_v}); {where} has {free >> 20} MiB free: lower -c or the prompt, evict in chunked "
                          "mode (--mode chunked: budget + chunk cells) or quantize it (-ctk/-ctv q8_0)")  # fmt: skip


def _note_untrained(model: Model, last: int) -> None:
    """Note once per model a decode at a position past its trained length (llama.cpp runs it; the
    model never learned it). Positions, not cells: a context sized with room to spare stays within
    them, and a chunked cache of few cells passes them on a long prompt."""
    n = model.info.n_ctx_train
    if n and last >= n and model.info.path not in _NOTED:
        _NOTED.add(model.info.path)
        name = pathlib.Path(model.info.path).name
        print(f"kvlite: note: position {last} is beyond the {n} positions {name} was trained on: llama.cpp "
              "runs it, but quality past them is not the model's", file=sys.stderr)  # fmt: skip


def _free_memory(model: Model) -> tuple[str, int | None]:
    if model.n_gpu_layers:
        from ..native import default_device, devices

        name = default_device()
        free = next((d["free_mib"] << 20 for d in devices() if d["name"] == name), None)
        return name, free or None  # a device that reports no memory (RPC, some iGPUs): not checked
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return "this machine", int(line.split()[1]) << 10
    except OSError:
        pass
    return "this machine", None  # not Linux: not checked


class Context:
    """A context whose sequences share one unified cell pool (workspace views need that: partial
    seq_cp aborts llama.cpp with per-sequence streams): one cache's live and workspace sequences, or
    a pool of `lanes` caches, each with its own two (lane_seqs), their cells interleaved."""

    def __init__(
        self,
        model: Model,
        n_ctx: int,
        n_batch: int = DEFAULT_CHUNK,
        n_threads: int | None = None,
        flash_attn: str = "auto",
        type_k: str = "f16",
        type_v: str = "f16",
        capture: Capture | None = None,
        swa_full: bool = True,
        lanes: int = 1,
    ):
        """swa_full: a sliding-window model's local layers get all n_ctx cells too (llama.cpp's
        default). A workspace needs it: a view pins every cell it views in the sliding layers' cache
        as well, and with the window-sized cache a lookahead or KVzip pass runs out of cells
        (docs/models.md, "Sliding-window models"). Without a workspace the window-sized cache holds
        the same cells in less memory. type_k/type_v: the cache types (cachetypes.CACHE_TYPES);
        flash_attn: on, off or auto (cachetypes.flash_attn_on). lanes: how many caches share the
        n_ctx cells (llama.cpp allows 256 sequences, two a cache)."""
        if n_ctx <= 0:
            raise KvliteError(f"context size must be positive, got {n_ctx}")
        if not 1 <= lanes <= MAX_LANES:
            raise KvliteError(f"a pool holds 1 to {MAX_LANES} conversations, got {lanes}")
        fa = cachetypes.check_types(type_k, type_v, flash_attn)
        cachetypes.check_head_dim(type_k, type_v, model.info.head_dim)
        self.model = model
        self.capture = capture
        p = L.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = p.n_ubatch = min(n_batch, n_ctx)
        p.n_seq_max = 2 * lanes
        p.kv_unified = True
        p.swa_full = swa_full
        self.flash_attn = cachetypes.flash_attn_on(fa, type_v)
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.n_threads = p.n_threads_batch = n_threads or default_threads()
        native().set_threads(p.n_threads)  # the score kernels run on as many threads as the decode
        p.type_k, p.type_v = cachetypes.CACHE_TYPES[type_k], cachetypes.CACHE_TYPES[type_v]
        self.type_k, self.type_v = type_k, type_v
        # how llama.cpp rotates what it stores, decided as it decides, when the context is made
        self.rotations = cachetypes.rotations(type_k, type_v, model.info.head_dim)
        n_embd_kv = model.info.n_head_kv * model.info.head_dim
        # K and V bytes one cell takes in one layer
        self.layer_cell_bytes = cachetypes.row_bytes(type_k, n_embd_kv) + cachetypes.row_bytes(type_v, n_embd_kv)
        _check_room(model, n_ctx, self.layer_cell_bytes, swa_full, type_k, type_v)
        p.no_perf = True
        if capture is not None:
            p.cb_eval = capture.callback
            p.cb_eval_user_data = capture.user_data
        LOG_BUFFERS.clear()
        self.ptr = L.llama_init_from_model(model.ptr, p)
        self.kv_buffers = logged_buffers("KV")  # where llama.cpp put the cache: {device: MiB}
        if not self.ptr:
            detail = LOG_ERRORS[-1] if LOG_ERRORS else "out of memory?"
            raise KvliteError(f"llama.cpp could not create a {n_ctx}-token context: {detail}")
        model.contexts.add(self)
        self.n_ctx = L.llama_n_ctx(self.ptr)
        self.n_batch = p.n_batch
        self.mem = L.llama_get_memory(self.ptr)
        self._batch = L.llama_batch_init(self.n_batch, 0, 2)
        self.lanes = lanes
        # The KVCaches on this context's cells (each registers itself). Weak: a cache holds its
        # context, and a cycle would keep a dropped context's cells allocated until a GC pass.
        self.caches: weakref.WeakSet = weakref.WeakSet()
        # A pool's lanes run on threads of their own: each call into llama.cpp holds the lock, and
        # their decodes meet in the batcher (one llama_decode for all who wait). Never held across a
        # decode or a native kernel: both run on the batcher's thread, which takes it.
        self.lock = threading.RLock()
        self.registry = threading.Lock()  # guards `caches`: counting cells never waits for a step
        self.batcher = Batcher(self) if lanes > 1 else None
        self._rows = threading.local()  # in a pool: this thread's last decode's logits (first index, rows)

    def cells_in_use(self) -> int:
        """Cells the caches on this context hold (llama.cpp has no public count)."""
        with self.registry:
            caches = list(self.caches)
        return sum(c.n_cells for c in caches)

    def free_cells(self) -> int:
        return self.n_ctx - self.cells_in_use()

    def close(self) -> None:
        if getattr(self, "batcher", None) is not None:
            self.batcher.close()
        if getattr(self, "ptr", None):
            if hasattr(self, "_batch"):  # not yet made when a Ctrl-C fell in __init__ between the two
                L.llama_batch_free(self._batch)
            L.llama_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_id: int = LIVE, logits: str = "last") -> None:
        """Decode tokens at the given positions on one sequence, n_batch at a time (in a pool, each
        piece in a step of the batcher, beside other lanes' decodes).

        logits: "last" (only the final token's row is kept), "all" or "none". Rows are indexed
        within the final piece, so "all" needs len(tokens) <= n_batch.
        """
        n = len(tokens)
        if n != len(positions):
            raise ValueError("tokens and positions differ in length")
        if logits == "all" and n > self.n_batch:
            raise ValueError(f"logits for all of {n} tokens need n_batch >= {n}")
        if n:
            _note_untrained(self.model, max(positions))
        for start in range(0, n, self.n_batch):
            end = min(start + self.n_batch, n)
            mode = logits if end == n else "none"
            if self.batcher is not None:
                rows = self.batcher.decode(Job(tokens[start:end], positions[start:end], seq_id, mode))
                self._rows.last = (end - start - len(rows) if rows is not None else 0, rows)
                continue
            b = self._batch
            b.n_tokens = fill_batch(b, 0, tokens[start:end], positions[start:end], seq_id, mode)
            with self.lock:
                rc = L.llama_decode(self.ptr, b)
            if rc != 0:
                raise decode_failed(rc, positions[start])

    def logits(self, i: int = -1) -> np.ndarray:
        """A copy of the logits of row i of the last decode's final piece (-1: its last row; in a
        pool, of this thread's last decode)."""
        if self.batcher is None:
            return self.logits_row(i)
        first, rows = getattr(self._rows, "last", (0, None))
        k = len(rows) - 1 if rows is not None and i == -1 else i - first
        if rows is None or not 0 <= k < len(rows):
            raise KvliteError(f"no logits for row {i} of the last decode")
        return rows[k].copy()

    def logits_row(self, i: int) -> np.ndarray:
        """A copy of row i of llama.cpp's logits of the last llama_decode."""
        with self.lock:
            ptr = L.llama_get_logits_ith(self.ptr, i)
            if not ptr:
                raise KvliteError(f"no logits for row {i} of the last decode")
            return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def sample(self, sampler: Sampler) -> int:
        """The next token, sampled from the last decode's last row (in a pool, this thread's)."""
        if self.batcher is None:
            with self.lock:
                return sampler.sample(self.ptr, -1)
        return sampler.sample_logits(self.logits(-1))

    # -- sequences ------------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        with self.lock:
            ok = L.llama_memory_seq_rm(self.mem, seq_id, p0, p1)
        if not ok:
            raise KvliteError(f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence {seq_id}")

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        with self.lock:
            L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def clear(self) -> None:
        with self.lock:
            L.llama_memory_clear(self.mem, True)

    def state_get(self, seq_id: int) -> bytearray:
        """The sequence's state blob, written by llama.cpp straight into the one buffer returned
        (no second copy: at 8K tokens on SmolLM2 a blob is ~190 MB)."""
        with self.lock:
            n = L.llama_state_seq_get_size(self.ptr, seq_id)
            blob = bytearray(n)
            written = L.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * n).from_buffer(blob), n, seq_id)
        del blob[written:]
        return blob

    def state_open(self, seq_id: int) -> kvstate.StateFile:
        """The sequence's state exported to a temporary file (TMPDIR) and opened to be read a layer at a
        time: what reading the cache costs in memory is one layer, not the whole export. The file is
        unlinked at once; its space returns when the StateFile closes."""
        with _temp_path() as path:
            self._save_file(path, seq_id)
            return kvstate.StateFile(path)

    def send(self, seq_id: int, to: Context, to_seq: int) -> None:
        """Copy the sequence's cells into another context's sequence (emptied first), through a
        temporary file that both sides stream a layer at a time: state_get and state_set would hold
        the whole export in memory beside the new context's cache."""
        with _temp_path() as path:
            self._save_file(path, seq_id)
            with to.lock:
                to._load_file(path, to_seq)

    def _save_file(self, path: str, seq_id: int) -> None:
        with self.lock:
            if not L.llama_state_seq_save_file(self.ptr, path.encode(), seq_id, None, 0):
                detail = LOG_ERRORS[-1] if LOG_ERRORS else "no detail"
                raise KvliteError(f"llama.cpp could not export sequence {seq_id} to {path} (disk full?): {detail}")

    def _load_file(self, path: str, seq_id: int) -> None:
        """Load a state file into the sequence; the caller holds the lock."""
        n_tokens = ctypes.c_size_t(0)
        if not L.llama_state_seq_load_file(self.ptr, path.encode(), seq_id, (L.llama_token * 1)(), 1,
                                           ctypes.byref(n_tokens)):  # fmt: skip
            detail = LOG_ERRORS[-1] if LOG_ERRORS else "no detail"
            raise KvliteError(f"llama.cpp could not load a KV state into sequence {seq_id}: {detail}")

    def reload(self, state: kvstate.SeqState, seq_id: int) -> None:
        """Load `state` into the sequence in place of what it holds, through a temporary file that both
        sides stream a layer at a time (state_set takes the whole blob in memory). The file is
        written first, so a full disk fails before the pool changes. The sequence is removed first,
        and llama.cpp puts its cells in free cells from the first one it freed (in a pool, other
        sequences' cells stay where they are; alone, the sequence starts at cell 0)."""
        with _temp_path() as path:
            try:
                kvstate.write(state, path)
            except OSError as e:
                raise KvliteError(f"could not write a KV state to {path} (disk full?): {e.strerror}") from None
            with self.lock:  # the sequence's cells are freed and taken again with no decode between
                if self.lanes == 1:
                    self.clear()  # the placement from cell 0 every single-cache run has had
                else:
                    self.seq_rm(seq_id, -1, -1)
                self._load_file(path, seq_id)

    def state_set(self, blob: bytes | bytearray, seq_id: int) -> None:
        if isinstance(blob, bytearray):  # read in place
            buf = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        else:
            buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        with self.lock:
            n = L.llama_state_seq_set_data(self.ptr, buf, len(blob), seq_id)
        if n != len(blob):
            detail = LOG_ERRORS[-1] if LOG_ERRORS else "no detail"
            raise KvliteError(f"llama.cpp could not load a KV state into sequence {seq_id}: {detail}")


class Pool:
    """One context whose cells `lanes` caches share (a server's conversations, docs/serve.md), with one
    eval callback that each lane's Runner sees as its own capture (PoolCapture.view). A lane is
    taken by a Runner for a conversation's life and given back when it closes. n_batch: a lane's
    prefill chunk; a decode step holds one and a token of every other lane."""

    def __init__(self, model: Model, n_cells: int, lanes: int, n_batch: int = DEFAULT_CHUNK,
                 n_threads: int | None = None, flash_attn: str = "auto", type_k: str = "f16",
                 type_v: str = "f16"):  # fmt: skip
        self.model = model
        self.capture = PoolCapture(model.info)
        # every policy may run on a lane, lookahead ones included: sliding layers keep all cells
        self.ctx = Context(model, n_cells, n_batch=n_batch + lanes, n_threads=n_threads, flash_attn=flash_attn,
                           type_k=type_k, type_v=type_v, capture=self.capture, swa_full=True, lanes=lanes)  # fmt: skip
        self.capture.lock = self.ctx.lock  # its wants are changed between steps, never during one
        self._free = list(range(lanes))

    def take(self) -> int:
        """A free lane (the lowest), or a one-line error when every lane holds a conversation."""
        if not self._free:
            raise KvliteError(f"every one of the pool's {self.ctx.lanes} conversations is taken")
        self._free.sort()
        return self._free.pop(0)

    def give_back(self, lane: int) -> None:
        self.capture.views.pop(lane, None)
        self._free.append(lane)

    def close(self) -> None:
        self.ctx.close()
        self.capture.close()
