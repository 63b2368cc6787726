"""The lookahead workspace: a view of some of a cache's live positions that a policy decodes a few
tokens on, to read their queries, while the live sequence stays as it is. Shared, it is the lane's
second sequence over the live cells; copied, the viewed cells go to a small context of their own
(docs/cache.md, "Where an eviction's time goes"). Dropped before the cache changes again."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .engine import LIVE, WORKSPACE, Context, kvstate
from .errors import KvliteError

if TYPE_CHECKING:
    from .cache import KVCache

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


class Workspace:
    """A cache's workspace (KVCache.workspace), at most one at a time."""

    def __init__(self, cache: KVCache):
        self.cache = weakref.proxy(cache)  # no cycle: a dropped cache frees its context at once
        # Set by a Runner of its own context: a new context of n cells (and the lookahead's) with
        # the cache's model, settings and capture, for a copied workspace (create)
        self.make_context: Callable[[int], Context] | None = None
        self.clear()

    def clear(self) -> None:
        self.active = False
        self.viewed = np.zeros(0, dtype=bool)  # live positions viewed, by position
        self.tokens: list[int] = []  # tokens decoded on the workspace only, from the cache's n_pos on
        self._side: Context | None = None  # the small context of a copied workspace

    def create(self, keep: Iterable[int]) -> None:
        """A view of some live positions. Shared: the workspace sequence views the live cells, and
        every lookahead step attends over the whole cache's span. Copied, when the view is at most
        1/COPY_AT of the resident cells and the Runner gave `make_context` (it does where
        copies_workspaces): the viewed cells go to a small context of their own, whose steps attend
        over those cells only."""
        if self.active:
            raise KvliteError("a workspace already exists")
        keep = np.unique(np.fromiter(keep, dtype=np.int64))
        self.active = True
        self.viewed = np.zeros(self.cache.n_pos, dtype=bool)
        self.tokens = []
        if self.make_context is not None and len(keep) * COPY_AT <= self.cache.n_resident:
            # room for this view: a later one of the same size (EchoKV's repair) removes cells
            # before it loads others (llama.cpp loads a sequence into free cells wherever they are)
            self._side = self.make_context(len(keep))
        try:
            self.add(keep)
        except BaseException:
            self.drop()
            raise

    @property
    def copied(self) -> bool:
        """Whether the active workspace is a copy in a small context of its own."""
        return self._side is not None

    @property
    def ctx(self) -> Context:
        """The context the workspace's tokens are decoded in (its logits are read there)."""
        return self._seq()[0]

    def _seq(self) -> tuple[Context, int]:
        """Where the workspace is: a copied one's context and its LIVE sequence, or the cache's
        context and the lane's WORKSPACE sequence."""
        return (self._side, LIVE) if self._side is not None else (self.cache.ctx, self.cache.seqs[WORKSPACE])

    def positions(self) -> np.ndarray:
        """The live positions viewed, then those of the tokens decoded on the workspace."""
        n_pos = self.cache.n_pos
        return np.concatenate([np.flatnonzero(self.viewed), np.arange(n_pos, n_pos + len(self.tokens))])

    def llama_positions(self) -> np.ndarray:
        """The positions llama.cpp holds for the workspace, read from its state export."""
        ctx, seq = self._seq()
        return kvstate.parse(ctx.state_get(seq)).positions()

    def add(self, positions: Iterable[int]) -> None:
        self._need()
        cache = self.cache
        add = np.unique(np.fromiter(positions, dtype=np.int64))
        if len(add) and not cache.resident(add).all():
            raise KvliteError("the workspace can only view resident live positions")
        add = add[~self.viewed[add]]
        if self._side is not None and len(add) > self._side_room():
            raise KvliteError(f"the workspace's context has no room for {len(add)} more viewed cells")
        for p0, p1 in runs(add):
            cache.ctx.seq_cp(cache.seqs[LIVE], cache.seqs[WORKSPACE], p0, p1)
        if self._side is not None and len(add):
            self._copy_to_side()
        self.viewed[add] = True

    def _copy_to_side(self) -> None:
        """Move the cells the workspace sequence views to the small context's view (its LIVE
        sequence): sent to its WORKSPACE sequence (llama.cpp empties a sequence it loads into),
        viewed from LIVE beside what it held, and the load's sequence emptied."""
        ctx, ws = self.cache.ctx, self.cache.seqs[WORKSPACE]
        try:
            ctx.send(ws, self._side, WORKSPACE)
        finally:
            ctx.seq_rm(ws, -1, -1)
        self._side.seq_cp(WORKSPACE, LIVE, -1, -1)
        self._side.seq_rm(WORKSPACE, -1, -1)

    def _side_room(self) -> int:
        """Cells free in a copied workspace's context: less those it views and has decoded."""
        return self._side.n_ctx - int(self.viewed.sum()) - len(self.tokens)

    def remove(self, positions: Iterable[int]) -> None:
        self._need()
        rm = np.unique(np.fromiter(positions, dtype=np.int64))
        rm = rm[rm < len(self.viewed)]
        rm = rm[self.viewed[rm]]
        ctx, seq = self._seq()
        for p0, p1 in runs(rm):
            ctx.seq_rm(seq, p0, p1)
        self.viewed[rm] = False

    def decode(self, tokens: Sequence[int], logits: str = "last") -> None:
        """Decode lookahead tokens on the workspace only, after the live sequence's last position."""
        self._need()
        cache = self.cache
        if not self.viewed[cache.n_pos - 1]:
            raise KvliteError("the workspace must view the last live position before decoding on it")
        start = cache.n_pos + len(self.tokens)
        free = cache.free if self._side is None else self._side_room()
        if len(tokens) > free:
            raise KvliteError("no room in the context for the lookahead tokens")
        ctx, seq = self._seq()
        ctx.decode(tokens, range(start, start + len(tokens)), seq, logits)
        if cache.hidden_layer is not None:
            cache.ctx.capture.take("hidden", cache.hidden_layer)  # lookahead tokens never enter the live cache
        self.tokens.extend(int(t) for t in tokens)
        cache.note_cells()

    def drop(self) -> None:
        self._need()
        self.cache.ctx.seq_rm(self.cache.seqs[WORKSPACE], -1, -1)
        if self._side is not None:
            self._side.close()  # its cells are freed with the eviction, not kept beside the cache
        self.clear()

    def _need(self) -> None:
        if not self.active:
            raise KvliteError("no workspace: create one first")
