"""The KV cache as kvlite sees it: which positions are resident on the live sequence and on the
workspace view, the tokens at them, and every operation that changes that. All sequence ops
(seq_rm, seq_cp, state load) happen here, so the bookkeeping and llama.cpp cannot drift apart.

Positions keep their original values after eviction (no re-rotation); new tokens continue at
pos_max + 1, so the token buffer is indexed by position.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from . import recall_store
from .cached_kv import CachedKV
from .engine import LIVE, WORKSPACE, Context, kvstate, lane_seqs
from .errors import KvliteError
from .workspace import Workspace, runs


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
        self.workspace = Workspace(self)
        self.keep_evicted = keep_evicted
        self._init(hidden_layer)

    def _init(self, hidden_layer: int | None) -> None:
        self.hidden_layer = hidden_layer
        self.hidden: np.ndarray | None = None  # [n_resident, n_embd], rows in position order
        self.tokens: list[int] = []  # every token of the live sequence, by position
        self._live = np.zeros(0, dtype=bool)  # resident flag, by position
        if self.workspace.active:
            self.workspace.drop()
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
        return self.n_resident + len(self.workspace.tokens)

    def positions(self, seq_id: int = LIVE) -> np.ndarray:
        """The positions kvlite holds resident on the live sequence (LIVE) or the workspace view."""
        if seq_id == LIVE:
            return np.flatnonzero(self._live)
        return self.workspace.positions()

    def resident(self, positions: np.ndarray) -> np.ndarray:
        """Whether each live position is resident."""
        return self._live[positions]

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
        if self.workspace.active:
            raise KvliteError(f"drop the workspace before {purpose}")
        return self.ctx.state_open(self.seqs[LIVE])

    def llama_positions(self, seq_id: int) -> np.ndarray:
        """The positions llama.cpp itself holds for the live sequence (LIVE) or the workspace (a
        copied one's: its own context's), read from its state export."""
        if seq_id == WORKSPACE:
            return self.workspace.llama_positions()
        return kvstate.parse(self.ctx.state_get(self.seqs[seq_id])).positions()

    @property
    def free(self) -> int:
        """Cells free in the context (a pool's: less every cache's)."""
        return self.ctx.free_cells()

    def note_cells(self) -> None:
        self.max_cells = max(self.max_cells, self.n_cells)

    # -- live sequence --------------------------------------------------------------------------
    def append(self, tokens: Sequence[int], logits: str = "last") -> None:
        """Decode tokens on the live sequence at the next positions."""
        if self.workspace.active:
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
        self.note_cells()

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
        self.note_cells()
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

    # -- whole cache ----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The live sequence, to be restored later into this or another context of the same model
        (an evaluation reads a prompt once and replays it under every policy)."""
        if self.workspace.active:
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
        self.hidden = None if self.hidden_layer is None else snap.hidden.copy()
        self.store = snap.store if self.keep_evicted else None
        self.evicted = evicted
        self.note_cells()

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
        if self.workspace.active:
            self.workspace.drop()
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
