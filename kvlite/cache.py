"""The KV cache as kvlite sees it: which positions are resident on the live sequence and on the
workspace view, the tokens at them, and every operation that changes that. All sequence ops
(seq_rm, seq_cp, state load) happen here, so the bookkeeping and llama.cpp cannot drift apart.

Positions keep their original values after eviction (no re-rotation); new tokens continue at
pos_max + 1, so the token buffer is indexed by position.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from . import recall_store
from .engine import LIVE, WORKSPACE, Context, cachetypes, kvstate, lane_seqs
from .errors import KvliteError
from .models import ModelInfo
from .native import native

# A workspace viewing at most 1/COPY_AT of the resident cells is copied to a small context: its
# steps then attend over well under half the cells, and the copy costs less than they save
COPY_AT = 4


def copies_workspaces(ctx: Context) -> bool:
    """Whether a cache on ctx copies a small workspace: only with its cells on the CPU, where the
    copy was measured to pay (docs/cache.md). On a GPU a lookahead step over the whole cache is
    cheap and a context costs device allocations; not measured yet, so device caches keep the
    shared view (the copy's mechanics pass there too: tests/test_cache_invariants.py)."""
    return set(ctx.kv_buffers) <= {"CPU"}


def runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions as half-open ranges of consecutive values: [1,2,3,7] -> [(1,4), (7,8)]."""
    if len(positions) == 0:
        return []
    p = np.asarray(positions, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(p)]])
    return [(int(p[s]), int(p[e - 1]) + 1) for s, e in zip(starts, ends)]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The live sequence as it was: llama.cpp's state blob and kvlite's bookkeeping beside it."""

    blob: bytes
    tokens: tuple[int, ...]
    live: np.ndarray
    hidden: np.ndarray | None
    hidden_layer: int | None
    store: kvstate.SeqState | None = None  # the evicted cells kept for recall (KVCache.store), shared

    @property
    def cells(self) -> int:
        """Cells the sequence takes once restored (its resident positions)."""
        return int(self.live.sum())

    @property
    def nbytes(self) -> int:
        """Host memory it holds: the cells' bytes in the cache's types, the hidden states, and
        the store of evicted cells where it is held in memory (recall_store.py)."""
        hidden = self.hidden.nbytes if self.hidden is not None else 0
        store = kvstate.nbytes(self.store) if recall_store.in_ram(self.store) else 0
        return len(self.blob) + hidden + self.live.nbytes + store


class CachedKV:
    """The live sequence's keys and values as llama.cpp cached them (post-RoPE keys), read from its
    state export one layer at a time (kvstate.StateFile), so an eviction holds one layer, not the
    cache twice. positions: [n] ascending; layer(il): keys [n_head_kv, n, head_dim] in that order, as
    attention reads them; k_rows/v_rows(il): the rows as stored. layers: the model's layers whose
    cache holds every cell (all but sliding-window ones, ModelInfo.full_layers), the ones readable.
    Rows of a quantized or bf16 cache come back as float32 vectors as the model made them:
    dequantized by ggml, then rotated back by the Hadamard matrices of `rotations` (K's and V's
    sizes, 0: none; Context.rotations), so every score reads the same vectors whatever the type."""

    def __init__(self, sf: kvstate.StateFile, info: ModelInfo, rotations: tuple[int, int] = (0, 0)):
        self.file, self.n_head_kv = sf, info.n_head_kv
        self.rotations = rotations
        self.n_embd_kv = info.n_head_kv * info.head_dim
        self.order = sf.by_position
        self.positions = sf.pos[self.order]
        self.layers = info.full_layers
        if sf.n_layer != len(self.layers):
            raise KvliteError(f"the state export holds {sf.n_layer} full layers, the model {len(self.layers)}")
        self._index = {il: i for i, il in enumerate(self.layers)}  # model layer -> the export's

    def _at(self, il: int) -> int:
        if il not in self._index:
            raise KvliteError(f"layer {il} slides over a window: its cache holds only the last cells")
        return self._index[il]

    def layer(self, il: int, cells: np.ndarray | None = None) -> np.ndarray:
        """Layer il's keys [n_head_kv, n, head_dim]; cells: only these (indices into `positions`)."""
        ggml_type, heads = self.layer_blocks(il, cells)
        if heads.dtype != np.uint8:
            return heads
        n = heads.shape[1]
        head_dim = self.n_embd_kv // self.n_head_kv
        return self._floats(heads.reshape(self.n_head_kv * n, -1), ggml_type, self.rotations[0], head_dim).reshape(
            self.n_head_kv, n, head_dim
        )

    def layer_blocks(self, il: int, cells: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Layer il's keys heads-first as stored: (ggml type, [n_head_kv, n, head_dim] f32 or f16, or
        the bytes [n_head_kv, n, head bytes] of another type: blocks never straddle heads,
        cachetypes.check_head_dim), still rotated (rotations[0]) for a quantized type."""
        order = self.order if cells is None else self.order[cells]
        at = self._at(il)
        return self.file.layout.k_types[at][0], heads_first(self.file.k(at, order), self.n_head_kv)

    def k_rows(self, il: int) -> np.ndarray:
        """Layer il's K rows [n, n_head_kv * head_dim] (f32 or f16 as stored; other types as f32), in
        the order of `positions`."""
        at = self._at(il)
        return self._floats(self.file.k(at, self.order), self.file.layout.k_types[at][0], self.rotations[0])

    def v_rows(self, il: int) -> np.ndarray:
        at = self._at(il)
        return self._floats(self.file.v(at, self.order), self.file.layout.v_types[at][0], self.rotations[1])

    def _floats(self, rows: np.ndarray, ggml_type: int, rotation: int, n_per_row: int | None = None) -> np.ndarray:
        """Rows as the model made them: f32/f16 as they are; other types widened by ggml, then
        turned back from llama.cpp's rotation (in place, in the one f32 copy)."""
        if rows.dtype in (np.float32, np.float16):  # numpy reads them as they are
            return rows
        raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1)  # bf16 bits or quantized blocks
        return cachetypes.unrotate(native().to_float(ggml_type, raw, n_per_row or self.n_embd_kv), rotation)

    def close(self) -> None:
        self.file.close()


def heads_first(rows: np.ndarray, n_head_kv: int) -> np.ndarray:
    """K rows [n, n_head_kv * head_dim] as stored -> [n_head_kv, n, head_dim] (f32 or f16), or the
    bytes [n_head_kv, n, head bytes] of another type."""
    heads = np.ascontiguousarray(rows.reshape(len(rows), n_head_kv, -1).transpose(1, 0, 2))
    if heads.dtype not in (np.float32, np.float16):
        heads = heads.view(np.uint8).reshape(n_head_kv, len(rows), -1)
    return heads


class JointKV:
    """The resident cells' keys (CachedKV) and the store's evicted ones together, in position order:
    what a recall scores, as attention would weigh a recalled cell beside the resident ones."""

    def __init__(self, resident: CachedKV, store: kvstate.SeqState):
        self.resident, self.stored = resident, store.streams[0]
        self.rotations, self.layers = resident.rotations, resident.layers
        both = np.concatenate([resident.positions, self.stored.pos])
        self.order = np.argsort(both, kind="stable")
        self.positions = both[self.order]

    def layer_blocks(self, il: int) -> tuple[int, np.ndarray]:
        k_type, heads = self.resident.layer_blocks(il)
        stored = heads_first(self.stored.k[self.resident._at(il)], self.resident.n_head_kv)
        return k_type, np.ascontiguousarray(np.concatenate([heads, stored], axis=1)[:, self.order])

    def close(self) -> None:
        self.resident.close()


def _stack(read, layers: Sequence[int]) -> np.ndarray:
    """[len(layers), ...] filled a layer at a time (no list of copies beside the result)."""
    out = None
    for i, il in enumerate(layers):
        rows = read(il)
        if out is None:
            out = np.empty((len(layers), *rows.shape), rows.dtype)
        out[i] = rows
    return out


class KVCache:
    def __init__(self, ctx: Context, hidden_layer: int | None = None, lane: int = 0, keep_evicted: bool = False):
        """hidden_layer: keep the residual stream after this layer (l_out) for every resident
        token, captured as tokens are decoded and evicted with them (counter-causal fast reads the
        input of the last layer). The context's capture must request it.
        lane: which of a pool's caches this is (Context(lanes=N)): its live and workspace sequences
        are lane_seqs(lane), and the room it has is the pool's cells less every cache's."""
        if hidden_layer is not None and (ctx.capture is None or not ctx.capture.wants("hidden", hidden_layer)):
            raise KvliteError(f"keeping hidden states needs a context capturing ('hidden', {hidden_layer})")
        if not 0 <= lane < ctx.lanes:
            raise KvliteError(f"lane {lane} is not one of the context's {ctx.lanes}")
        self.ctx = ctx
        self.lane = lane
        self.seqs = lane_seqs(lane)  # indexed by LIVE and WORKSPACE
        with ctx.registry:
            if ctx.lanes > 1 and any(c.lane == lane for c in ctx.caches):
                raise KvliteError(f"lane {lane} already holds a cache")
            if ctx.lanes == 1:  # a context of one cache: a new cache on it takes over (tests do that)
                ctx.caches.clear()
            ctx.caches.add(self)
        # Set by a Runner of its own context: a new context of n cells (and the lookahead's) with
        # the cache's model, settings and capture, for a copied workspace (workspace_create)
        self.workspace_context: Callable[[int], Context] | None = None
        self.keep_evicted = keep_evicted
        self._init(hidden_layer)

    def _init(self, hidden_layer: int | None) -> None:
        self.hidden_layer = hidden_layer
        self.hidden: np.ndarray | None = None  # [n_resident, n_embd], rows in position order
        self.tokens: list[int] = []  # every token of the live sequence, by position
        self._live = np.zeros(0, dtype=bool)  # resident flag, by position
        self._ws_prompt = np.zeros(0, dtype=bool)  # live positions viewed by the workspace
        self._ws_tokens: list[int] = []  # tokens decoded on the workspace only, from n_pos on
        self.workspace_active = False
        self._side: Context | None = None  # the small context of a copied workspace, while one is active
        self.evicted = 0  # positions evicted from the live sequence so far
        # keep_evicted: what evict() drops is kept here, bit for bit, for recall() (kvstate.held)
        self.store: kvstate.SeqState | None = None
        self.max_cells = 0  # the most cells resident at once (live + workspace-only)

    # -- what is resident -----------------------------------------------------------------------
    @property
    def n_pos(self) -> int:
        """Positions used so far on the live sequence (the next token goes here)."""
        return len(self.tokens)

    @property
    def n_resident(self) -> int:
        return int(self._live.sum())

    @property
    def n_cells(self) -> int:
        """Cells this cache holds in the context: its resident positions and the workspace's own."""
        return self.n_resident + len(self._ws_tokens)

    def positions(self, seq_id: int = LIVE) -> np.ndarray:
        """The positions kvlite holds resident on the live sequence (LIVE) or the workspace view."""
        if seq_id == LIVE:
            return np.flatnonzero(self._live)
        ws = np.flatnonzero(self._ws_prompt)
        return np.concatenate([ws, np.arange(self.n_pos, self.n_pos + len(self._ws_tokens))])

    def tokens_at(self, positions: Iterable[int]) -> list[int]:
        return [self.tokens[p] for p in positions]

    def read_kv(self, layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The live sequence's cached keys and values as llama.cpp holds them (state export, never
        recomputed): positions [n] ascending, K and V [len(layers), n, n_head_kv * head_dim]. Every
        layer at once, for tests and benchmarks; an eviction reads a layer at a time (cached_kv)."""
        kv = self.cached_kv()
        try:
            return kv.positions, _stack(kv.k_rows, layers), _stack(kv.v_rows, layers)
        finally:
            kv.close()

    def cached_kv(self) -> CachedKV:
        """The live sequence's cached K/V, to be read a layer at a time (closed with it, or by GC)."""
        return CachedKV(self._live_file("reading the live cache"), self.ctx.model.info, self.ctx.rotations)

    def _live_file(self, purpose: str) -> kvstate.StateFile:
        if self.workspace_active:
            raise KvliteError(f"drop the workspace before {purpose}")
        return self.ctx.state_open(self.seqs[LIVE])

    def llama_positions(self, seq_id: int) -> np.ndarray:
        """The positions llama.cpp itself holds for the live sequence (LIVE) or the workspace (a
        copied one's: its own context's), read from its state export."""
        if seq_id == WORKSPACE and self._side is not None:
            return kvstate.parse(self._side.state_get(LIVE)).positions()
        return kvstate.parse(self.ctx.state_get(self.seqs[seq_id])).positions()

    @property
    def free(self) -> int:
        """Cells free in the context (a pool's: less every cache's)."""
        return self.ctx.free_cells()

    def _note_cells(self) -> None:
        self.max_cells = max(self.max_cells, self.n_cells)

    # -- live sequence --------------------------------------------------------------------------
    def append(self, tokens: Sequence[int], logits: str = "last") -> None:
        """Decode tokens on the live sequence at the next positions."""
        if self.workspace_active:
            raise KvliteError("drop the workspace before extending the live sequence")
        if not tokens:
            return
        free = self.free
        if len(tokens) > free:
            if self.ctx.lanes > 1:
                raise KvliteError(f"the pool has room for {free} more tokens, {len(tokens)} were fed: other "
                                  f"conversations hold {self.ctx.cells_in_use() - self.n_cells} of its "
                                  f"{self.ctx.n_ctx} cells (--kv-cells)")  # fmt: skip
            raise KvliteError(
                f"the context has room for {free} more tokens, {len(tokens)} were fed: "
                f"raise -c (now {self.ctx.n_ctx}) or use an evicting policy"
            )
        start = self.n_pos
        positions = range(start, start + len(tokens))
        self.ctx.decode(tokens, positions, self.seqs[LIVE], logits)
        if self.hidden_layer is not None:
            rows = self.ctx.capture.for_lane(self.lane).take("hidden", self.hidden_layer)
            self.hidden = rows if self.hidden is None else np.concatenate([self.hidden, rows])
        self.tokens.extend(int(t) for t in tokens)
        self._live = np.concatenate([self._live, np.ones(len(tokens), dtype=bool)])
        self._ws_prompt = np.concatenate([self._ws_prompt, np.zeros(len(tokens), dtype=bool)])
        self._note_cells()

    def evict(self, keep: Iterable[int]) -> int:
        """Keep only `keep` (resident positions) on the live sequence; returns how many left.

        The last position always stays: new tokens continue at pos_max + 1, and llama.cpp takes
        pos_max from the cells."""
        keep_mask = np.zeros_like(self._live)
        keep_idx = np.fromiter(keep, dtype=np.int64)
        if len(keep_idx) and (keep_idx.min() < 0 or keep_idx.max() >= self.n_pos):
            raise KvliteError("keep-set holds positions outside the sequence")
        keep_mask[keep_idx] = True
        if not self._live[keep_idx].all():
            raise KvliteError("keep-set holds positions that are not resident")
        if self.n_pos and not keep_mask[self.n_pos - 1]:
            raise KvliteError("the last position must be kept")
        gone = np.flatnonzero(self._live & ~keep_mask)
        if self.keep_evicted and len(gone):
            self._keep(gone)
        # One seq_rm per run of consecutive *resident* positions to remove; holes between
        # them are already free, so the range may span them.
        resident = self.positions(LIVE)
        drop = ~keep_mask[resident]
        for lo, hi in runs(np.flatnonzero(drop)):
            self.ctx.seq_rm(self.seqs[LIVE], int(resident[lo]), int(resident[hi - 1]) + 1)
        if self.hidden is not None:
            self.hidden = self.hidden[~drop]
        self._live[gone] = False
        self.evicted += len(gone)
        return len(gone)

    def _keep(self, gone: np.ndarray) -> None:
        """The cells about to be evicted, added to the store in the cache's own types."""
        if self.hidden is not None:
            raise KvliteError("evicted cells cannot be kept for a policy that scores hidden states")
        with self._live_file("keeping evicted cells") as sf:
            kept = kvstate.held(sf.state(self.seqs[LIVE], by_position=True, positions=gone))
        self.store = recall_store.keep(kvstate.merge(self.store, kept), replacing=self.store)

    @property
    def stored(self) -> np.ndarray:
        """The positions whose evicted cells the store holds, ascending."""
        return np.empty(0, np.int32) if self.store is None else self.store.streams[0].pos

    def recall(self, positions: Iterable[int]) -> int:
        """Bring stored cells back to the live sequence at their own positions, bit for bit (a
        sliding-window layer's only where they are still inside its window); returns how many."""
        pos = np.unique(np.fromiter(positions, dtype=np.int64))
        if not len(pos):
            return 0
        if not np.isin(pos, self.stored).all():
            raise KvliteError("recall names positions the store does not hold")
        if len(pos) > self.free:
            raise KvliteError(f"no room to recall {len(pos)} cells: the context has {self.free} free")
        window = self.ctx.model.info.n_swa
        last = self.n_pos - 1

        def back(section: int, p: np.ndarray) -> np.ndarray:
            return np.isin(p, pos) & ((p > last - window) if section and window else True)

        live = self.seqs[LIVE]
        with self._live_file("recalling evicted cells") as sf:
            resident = sf.state(live, by_position=True)
            try:
                self.ctx.reload(kvstate.merge(resident, kvstate.select(self.store, back)), live)
            except KvliteError:
                self.ctx.seq_rm(live, -1, -1)  # put back what was there: the cache stays consistent
                self.ctx.state_set(kvstate.build(sf.state(live)), live)
                raise
        left = kvstate.select(self.store, lambda _, p: ~np.isin(p, pos), lazy=True)
        self.store = recall_store.keep(left, replacing=self.store)
        self._live[pos] = True
        self._note_cells()
        return len(pos)

    def reread_last(self) -> bool:
        """Decode the last position again in place, so that its logits (the reply's first token)
        and its cell attend to cells recalled after it was read. Only where the position before it
        is resident: llama.cpp takes a sequence's new tokens only right after its last position.
        Returns whether it was read again."""
        last, live = self.n_pos - 1, self.seqs[LIVE]
        if last < 1 or not self._live[last - 1]:
            return False
        self.ctx.seq_rm(live, last, last + 1)
        self.ctx.decode([self.tokens[last]], [last], live, "last")
        return True

    def compact(self) -> None:
        """Move the live cells to the front of the cell pool in position order, so the attended
        range (n_kv, the highest used cell rounded up) follows the resident count, not the history.

        Exports the live sequence to a file and loads it back in position order, a layer at a time.
        Cached values are copied bit for bit, so only the speed changes. In a pool the cells go
        where llama.cpp finds them free; other caches' cells do not move."""
        live = self.seqs[LIVE]
        with self._live_file("compacting") as sf:
            try:
                self.ctx.reload(sf.state(live, by_position=True), live)
            except KvliteError:
                self.ctx.seq_rm(live, -1, -1)  # put back what was there: the cache stays consistent
                self.ctx.state_set(kvstate.build(sf.state(live)), live)
                raise

    # -- workspace view (the lane's second sequence, or a small context of its own) -------------
    def workspace_create(self, keep: Iterable[int]) -> None:
        """A view of some live positions. Shared: the workspace sequence views the live cells, and
        every lookahead step attends over the whole cache's span. Copied, when the view is at most
        1/COPY_AT of the resident cells and the Runner gave a `workspace_context` (it does where
        copies_workspaces): the viewed cells go to a small context of their own, whose steps attend
        over those cells only (docs/cache.md, "Where an eviction's time goes")."""
        if self.workspace_active:
            raise KvliteError("a workspace already exists")
        keep = np.unique(np.fromiter(keep, dtype=np.int64))
        self.workspace_active = True
        self._ws_prompt[:] = False
        self._ws_tokens = []
        if self.workspace_context is not None and len(keep) * COPY_AT <= self.n_resident:
            # room for this view: a later one of the same size (EchoKV's repair) removes cells
            # before it loads others (llama.cpp loads a sequence into free cells wherever they are)
            self._side = self.workspace_context(len(keep))
        try:
            self.workspace_add(keep)
        except BaseException:
            self.workspace_drop()
            raise

    @property
    def workspace_copied(self) -> bool:
        """Whether the active workspace is a copy in a small context of its own."""
        return self._side is not None

    @property
    def workspace_ctx(self) -> Context:
        """The context the workspace's tokens are decoded in (its logits are read there)."""
        return self._workspace_seq()[0]

    def _workspace_seq(self) -> tuple[Context, int]:
        """Where the workspace is: a copied one's context and its LIVE sequence, or the cache's
        context and the lane's WORKSPACE sequence."""
        return (self._side, LIVE) if self._side is not None else (self.ctx, self.seqs[WORKSPACE])

    def workspace_add(self, positions: Iterable[int]) -> None:
        self._need_workspace()
        add = np.unique(np.fromiter(positions, dtype=np.int64))
        if len(add) and not self._live[add].all():
            raise KvliteError("the workspace can only view resident live positions")
        add = add[~self._ws_prompt[add]]
        if self._side is not None and len(add) > self._side_room():
            raise KvliteError(f"the workspace's context has no room for {len(add)} more viewed cells")
        for p0, p1 in runs(add):
            self.ctx.seq_cp(self.seqs[LIVE], self.seqs[WORKSPACE], p0, p1)
        if self._side is not None and len(add):
            self._copy_to_side()
        self._ws_prompt[add] = True

    def _copy_to_side(self) -> None:
        """Move the cells the workspace sequence views to the small context's view (its LIVE
        sequence): exported, loaded into its WORKSPACE sequence (llama.cpp empties a sequence it
        loads into), viewed from LIVE beside what it held, and the load's sequence emptied."""
        ws = self.seqs[WORKSPACE]
        try:
            blob = self.ctx.state_get(ws)
        finally:
            self.ctx.seq_rm(ws, -1, -1)
        self._side.state_set(blob, WORKSPACE)
        self._side.seq_cp(WORKSPACE, LIVE, -1, -1)
        self._side.seq_rm(WORKSPACE, -1, -1)

    def _side_room(self) -> int:
        """Cells free in a copied workspace's context: less those it views and has decoded."""
        return self._side.n_ctx - int(self._ws_prompt.sum()) - len(self._ws_tokens)

    def workspace_remove(self, positions: Iterable[int]) -> None:
        self._need_workspace()
        rm = np.unique(np.fromiter(positions, dtype=np.int64))
        rm = rm[(rm < self.n_pos)]
        rm = rm[self._ws_prompt[rm]]
        ctx, seq = self._workspace_seq()
        for p0, p1 in runs(rm):
            ctx.seq_rm(seq, p0, p1)
        self._ws_prompt[rm] = False

    def workspace_decode(self, tokens: Sequence[int], logits: str = "last") -> None:
        """Decode lookahead tokens on the workspace only, after the live sequence's last position."""
        self._need_workspace()
        if not self._ws_prompt[self.n_pos - 1]:
            raise KvliteError("the workspace must view the last live position before decoding on it")
        start = self.n_pos + len(self._ws_tokens)
        free = self.free if self._side is None else self._side_room()
        if len(tokens) > free:
            raise KvliteError("no room in the context for the lookahead tokens")
        ctx, seq = self._workspace_seq()
        ctx.decode(tokens, range(start, start + len(tokens)), seq, logits)
        if self.hidden_layer is not None:
            self.ctx.capture.take("hidden", self.hidden_layer)  # lookahead tokens never enter the live cache
        self._ws_tokens.extend(int(t) for t in tokens)
        self._note_cells()

    def workspace_drop(self) -> None:
        self._need_workspace()
        self.ctx.seq_rm(self.seqs[WORKSPACE], -1, -1)
        if self._side is not None:
            self._side.close()  # its cells are freed with the eviction, not kept beside the cache
            self._side = None
        self._ws_prompt[:] = False
        self._ws_tokens = []
        self.workspace_active = False

    def _need_workspace(self) -> None:
        if not self.workspace_active:
            raise KvliteError("no workspace: create one first")

    # -- whole cache ----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The live sequence, to be restored later into this or another context of the same model
        (an evaluation reads a prompt once and replays it under every policy)."""
        if self.workspace_active:
            raise KvliteError("drop the workspace before taking a snapshot")
        hidden = None if self.hidden is None else self.hidden.copy()
        blob = self.ctx.state_get(self.seqs[LIVE])
        # the store itself, not a copy: a store is never changed in place, only replaced
        return Snapshot(blob, tuple(self.tokens), self._live.copy(), hidden, self.hidden_layer, self.store)

    def restore(self, snap: Snapshot, evicted: int = 0) -> None:
        """Replace the whole cache with a snapshot's live sequence. evicted: how many positions the
        sequence had evicted before it was saved (a server's slot file), else none."""
        if self.hidden_layer is not None and snap.hidden_layer != self.hidden_layer:
            raise KvliteError(f"this cache keeps hidden states of layer {self.hidden_layer}; the snapshot does not")
        self.reset()
        if snap.cells > self.free:
            raise KvliteError(f"the snapshot holds {snap.cells} cells; the context has {self.free} free")
        self.ctx.state_set(snap.blob, self.seqs[LIVE])
        self.tokens = list(snap.tokens)
        self._live = snap.live.copy()
        self._ws_prompt = np.zeros_like(self._live)
        self.hidden = None if self.hidden_layer is None else snap.hidden.copy()
        self.store = snap.store if self.keep_evicted else None
        self.evicted = evicted
        self._note_cells()

    @contextlib.contextmanager
    def peak_within(self) -> Iterator[list[int]]:
        """The most cells resident during a span (a server's request), in the list it yields once
        the span ends; max_cells is the cache's peak over its whole life again afterwards."""
        before, self.max_cells = self.max_cells, self.n_resident
        peak = [self.max_cells]
        try:
            yield peak
        finally:
            peak[0] = self.max_cells
            self.max_cells = max(before, peak[0])

    def reset(self) -> None:
        if self.ctx.lanes == 1:
            self.ctx.clear()
        else:  # only this cache's sequences: the pool's others stay
            for seq in self.seqs:
                self.ctx.seq_rm(seq, -1, -1)
        self._init(self.hidden_layer)

    def release(self) -> None:
        """Free this cache's cells and its lane (a pool's conversation that ends)."""
        self.reset()
        with self.ctx.registry:
            self.ctx.caches.discard(self)

    def truncate(self, n_pos: int) -> None:
        """Forget every position from n_pos on (undo a partly fed turn). If eviction removed the
        positions just below n_pos, the sequence ends at its last resident one instead."""
        if self.workspace_active:
            self.workspace_drop()
        if n_pos >= self.n_pos:
            return
        self.ctx.seq_rm(self.seqs[LIVE], n_pos, -1)
        if self.hidden is not None:
            self.hidden = self.hidden[: int(self._live[:n_pos].sum())]
        below = np.flatnonzero(self._live[:n_pos])
        end = int(below[-1]) + 1 if len(below) else 0
        self.tokens = self.tokens[:end]
        self._live = self._live[:end]
        if self.store is not None:  # cells evicted while the forgotten positions were read
            self.store = recall_store.keep(kvstate.select(self.store, lambda _, p: p < end, lazy=True), self.store)
        self._ws_prompt = self._ws_prompt[:end]
