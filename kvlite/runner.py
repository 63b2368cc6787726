"""A model, a context sized for a policy, and the loop that feeds tokens, evicts and generates.

Where "when to evict" is decided, from the policy out:
- the policy's mode (`Policy.continuous`): prefill-end evicts once the tokens are read; chunked
  (`--mode chunked`, streaming's default) evicts as it reads, after every chunk (`Runner.feed`);
- here: `feed(evict=True)` evicts to the budget once a prompt or a turn is read, when the cache
  is over it (`over_budget`, `_evict_to_budget`), and compacts;
- a chat's mode (evict.py): eager evicts every turn; lazy (`make_room`) feeds a turn with
  `evict=False` until the turn and its reply would not fit under the cap, then evicts with that
  turn's queries (first, with the last turn's, when the turn alone does not fit beside what is
  resident). `evict_mode` picks the mode for `kvlite chat`, the server and the eval grid;
- recall (`Runner.recall`) brings cells back after a turn is read, never evicts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from .cache import KVCache, Snapshot
from .cached_kv import JointKV
from .engine import Capture, Context, Model, Pool, Sampler, SamplingParams
from .errors import KvliteError
from .evict import RECALL_LOOKAHEAD, check_recall
from .policies import FullKV, Policy
from .policies.observe import Observation, pooled
from .reports import Eviction, Mark, Timings
from .scoring.aggregate import aggregate
from .selection import protected_positions, ranked, select_keep
from .settings import RunSettings
from .workspace import copies_workspaces

SPLIT_OBSERVED = 64  # a chunk's observed tail gets its own batch when this many tokens precede it


class Runner:
    """Feeds text through one context under one policy. Interrupting (the `interrupted` callable
    returning True) stops between tokens or chunks, never inside llama.cpp, so the cache stays
    consistent. settings.n_ctx is the context as allocated (Session plans it; 0 is not allowed)."""

    def __init__(self, model: Model, policy: Policy | None = None, settings: RunSettings | None = None,
                 pool: Pool | None = None, recall: int = 0):  # fmt: skip
        """pool: run on a lane of this shared context (a server's conversations) instead of a context
        of its own; settings.n_ctx is then this conversation's cap, the pool's cells its room.
        recall: keep what is evicted in a host store and bring back up to this many of its cells
        when a turn has been read (recall())."""
        settings = settings or RunSettings(n_ctx=4096)
        if not settings.n_ctx:
            raise KvliteError("a Runner needs a planned context size (plan_context)")
        self.model = model
        self.policy = policy or FullKV()
        self.policy.validate()
        self.policy.check_model(model.info)
        self.settings = settings
        self.chunk = settings.chunk
        self.pool = pool
        lane = pool.take() if pool is not None else 0
        try:
            self.capture = self._capture_for(self.policy, (lambda: pool.capture.view(lane)) if pool else None)
            # The capture is switched on and off around the tokens whose queries the policy reads
            # (a hidden-state capture stays on: every token's row is kept).
            self.watches_queries = self.capture is not None and not self.policy.needs_hidden
            self.recall_cells = check_recall(recall, self.policy)
            if pool is None:
                self.ctx = self._context(settings.n_ctx, settings.chunk, swa_full=self.policy.lookahead_cells() > 0)
            else:
                self.ctx = pool.ctx
            hidden_layer = model.info.n_layer - 2 if self.policy.needs_hidden else None
            self.cache = KVCache(self.ctx, hidden_layer=hidden_layer, lane=lane, keep_evicted=recall > 0)
            # a pool's lanes keep the shared view: their decodes meet in one batch on one context
            if pool is None and self.policy.lookahead_cells() and copies_workspaces(self.ctx):
                self.cache.workspace.make_context = self._workspace_context
        except BaseException:
            if pool is not None:
                pool.give_back(lane)
            raise
        # the most cells the conversation may hold: its own context's, or its cap in a pool
        self.cap = self.ctx.n_ctx if pool is None else settings.n_ctx
        self.observed: dict[str, np.ndarray] = {}  # queries of the last tokens fed, per kind [L, n, H, D]
        # the lookahead queries of an eviction after the tokens fed last ([L, H, n, D] each; eager mode)
        self.turn_lookahead: list[np.ndarray] = []
        self.recall_lookahead = RECALL_LOOKAHEAD
        self.question: bool | None = None  # whether the tokens fed last end with a question (feed)
        self.sampler = Sampler(settings.sampling)
        self._reset_counters()
        # When a list: the positions resident after each eviction (the cache-evolution picture).
        self.history: list[np.ndarray] | None = None

    def _context(self, n_ctx: int, n_batch: int, swa_full: bool) -> Context:
        """A context of the runner's model, settings and capture."""
        s = self.settings
        return Context(self.model, n_ctx, n_batch=n_batch, n_threads=s.n_threads, flash_attn=s.flash_attn,
                       type_k=s.type_k, type_v=s.type_v, capture=self.capture, swa_full=swa_full)  # fmt: skip

    def _workspace_context(self, n_cells: int) -> Context:
        """A context for a copied lookahead workspace: n_cells viewed and the lookahead's tokens,
        decoded one at a time."""
        return self._context(n_cells + self.policy.lookahead_cells() + 1, min(self.settings.chunk, 64), swa_full=True)

    def _reset_counters(self) -> None:
        self.timings = Timings()
        self.workspace_forward_passes = 0
        self.last_eviction: Eviction | None = None
        self.kept_positions: np.ndarray | None = None
        self._next_logits: np.ndarray | None = None  # the prompt's own, when a lookahead overwrote llama.cpp's
        self._compact_due = False

    def _capture_for(self, policy: Policy, make: Callable[[], Capture] | None = None) -> Capture | None:
        """Ask llama.cpp only for what the policy observes. make: the capture to ask on (a pool
        lane's view of the pool's; default a new one)."""
        n_layer = self.model.info.n_layer
        layers = self.model.info.full_layers  # scores read the layers that hold every cell
        wants_queries = policy.observed_tokens() > 0 or policy.lookahead_cells() > 0
        if not wants_queries and not policy.needs_hidden:
            return None
        capture = make() if make else Capture(self.model.info)
        if policy.needs_hidden:
            capture.request("hidden", [n_layer - 2])  # always on: every token's row is kept
        if wants_queries:
            if policy.needs_hidden:
                raise KvliteError("a policy observing both queries and hidden states is not supported yet")
            for kind in policy.captures:
                capture.request(kind, layers)
            capture.enabled = False  # switched on for the tokens observed
        return capture

    def restore(self, snap: Snapshot, evicted: int = 0) -> None:
        """Start over from a snapshot of a prompt read earlier (in this or another runner).
        evicted: what the snapshot's sequence had evicted before (a server's slot file)."""
        self.cache.restore(snap, evicted)
        self.observed = {}
        self._reset_counters()
        if self.capture is not None:
            self.capture.clear()

    def use_sampling(self, params: SamplingParams) -> None:
        """Sample the next replies with these parameters (a server's per-request temperature)."""
        if params != self.sampler.params:
            self.sampler.close()
            self.sampler = Sampler(params)

    def close(self) -> None:
        self.sampler.close()
        if self.pool is None:
            self.ctx.close()
        elif self.cache in self.ctx.caches:  # its cells and its lane go back to the pool
            self.cache.release()
            self.pool.give_back(self.cache.lane)

    # -- eviction -------------------------------------------------------------------------------
    def observation(self) -> Observation:
        """What the policy may look at now (the live cache, the captured queries, the context for a
        lookahead)."""
        return Observation(self.cache, self.model, self.observed, ctx=self.ctx, capture=self.capture,
                           question=self.question)  # fmt: skip

    def over_budget(self, n_new: int = 0) -> bool:
        """Whether the cache, with n_new more cells, holds more than the policy's budget."""
        budget = self.policy.budget
        return budget is not None and self.cache.n_resident + n_new > budget

    def _evict_to_budget(self) -> Eviction | None:
        budget = self.policy.budget
        if not self.over_budget():
            return None
        t0 = time.perf_counter()
        obs = self.observation()
        try:
            scores = np.asarray(self.policy.scores(obs))
        finally:
            obs.close()
            if self.cache.workspace.active:
                self.cache.workspace.drop()  # lookahead cells never outlive the scoring
        if scores.shape != obs.positions.shape:
            raise KvliteError(f"--policy {self.policy.name} gave {scores.shape} scores for {len(obs.positions)} cells")
        keep = select_keep(
            obs.positions, scores, budget, protected_positions(obs.positions, self.policy.sinks, self.policy.window)
        )
        eviction = Eviction(obs.positions, scores, keep, obs.workspace_views, obs.workspace_forward_passes,
                            obs.next_logits, obs.method or self.policy.name, obs.lookahead_queries)  # fmt: skip
        if self.cache.evict(keep):
            self._compact_due = True
        self.workspace_forward_passes += eviction.workspace_forward_passes
        if eviction.next_logits is not None:
            self._next_logits = eviction.next_logits
        if self.history is not None:
            self.history.append(np.asarray(keep))
        self.last_eviction = eviction
        self.timings.evict_s += time.perf_counter() - t0
        return eviction

    def evict(self) -> Eviction | None:
        """Evict to the budget now (if the cache is over it) and compact."""
        eviction = self._evict_to_budget()
        self._compact()
        self.kept_positions = self.cache.positions()
        return eviction

    def recall(self, room: int) -> int:
        """Bring back the stored cells that the queries of the tokens just read attend most (their
        attention beside the resident cells, max over layers and heads), at most recall_cells and
        room, and read the last token again beside them. Returns how many came back. With
        recall_lookahead, the queries of a lookahead that evicted after those tokens count too."""
        n = min(self.recall_cells, room, len(self.cache.stored))
        if n <= 0 or "q" not in self.observed:
            return 0
        t0 = time.perf_counter()
        keys = JointKV(self.cache.cached_kv(), self.cache.store)
        try:
            ahead = self.turn_lookahead if self.recall_lookahead else []
            queries = np.ascontiguousarray(np.concatenate([self.observed["q"].transpose(0, 2, 1, 3), *ahead], axis=2))
            scores = aggregate(pooled(queries, keys, self.model.info.kq_scale), "max")
        finally:
            keys.close()
        stored = np.isin(keys.positions, self.cache.stored)
        candidates = keys.positions[stored]
        self.cache.recall(candidates[ranked(candidates, scores[stored])[:n]])
        if self.cache.reread_last():  # the reply's first token sees them too
            self._next_logits = None  # a lookahead's saved copy of the last token's logits is stale now
        self.kept_positions = self.cache.positions()
        self.timings.recall_s += time.perf_counter() - t0
        return n

    def _compact(self) -> None:
        if self._compact_due:
            t0 = time.perf_counter()
            self.cache.compact()
            self._compact_due = False
            self.timings.evict_s += time.perf_counter() - t0

    # -- feeding and generating -----------------------------------------------------------------
    def feed(
        self,
        tokens: Sequence[int],
        progress: Callable[[int], None] | None = None,
        interrupted: Callable[[], bool] = lambda: False,
        evict: bool = True,
        question: bool | None = None,
    ) -> bool:
        """Prefill tokens in chunks (refreshing after each in chunked mode), then evict to the budget
        (unless evict=False: a lazy chat keeps the turn until the cache needs room, then calls
        evict()). question: whether these tokens end with a question the reply answers (None:
        unknown), for policies that score a document turn differently (Observation.question).
        Returns False if interrupted (the tokens fed so far stay)."""
        self.question = question
        self.turn_lookahead = []
        if not tokens:
            raise KvliteError("nothing to feed: the prompt is empty")
        t0 = time.perf_counter()
        observe_from = len(tokens) - self.policy.observed_tokens() if self.policy.observed_tokens() else len(tokens)
        watching = self.watches_queries
        try:
            for start, end in self._pieces(len(tokens), observe_from if watching else len(tokens)):
                if interrupted():
                    return False
                piece = tokens[start:end]
                if watching:  # chunked mode observes every chunk's last tokens
                    self.capture.enabled = self.policy.continuous or start + len(piece) > observe_from
                self.cache.append(piece, logits="last")
                self.timings.prefill_tokens += len(piece)
                if self.policy.continuous:
                    self._refresh()
                if progress:
                    progress(len(piece))
            if watching:
                self.capture.enabled = False
                self._keep_observed()
            if evict and (eviction := self.evict()) is not None:
                self.turn_lookahead = eviction.lookahead_queries
            return True
        finally:
            self.timings.prefill_s += time.perf_counter() - t0
            self.kept_positions = self.cache.positions()

    def _pieces(self, n: int, observe_from: int) -> list[tuple[int, int]]:
        """Prefill batches of `chunk` tokens. In prefill-end mode the observed tail is its own batch
        when the rest of its chunk is long: the capture then holds the rows the policy reads, not
        a whole chunk's (a 512-token chunk's queries are ~70 MB on SmolLM2)."""
        bounds = [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]
        if self.policy.continuous or observe_from >= n:
            return bounds
        a, b = bounds[-1]
        if observe_from - a >= SPLIT_OBSERVED:
            bounds[-1:] = [(a, observe_from), (observe_from, b)]
        return bounds

    def _keep_observed(self) -> None:
        """Move the captured queries of the last tokens out of the capture (the policy's window of
        them, older ones included when the newest chunk is shorter than the window)."""
        data = self.capture.data
        layers = self.model.info.full_layers
        keep = max(self.policy.observed_tokens(), 1)
        for kind in ("q", "q_pre"):
            if (kind, layers[0]) in data:
                rows = np.stack([np.concatenate(data[(kind, il)]) for il in layers])
                if kind in self.observed:
                    rows = np.concatenate([self.observed[kind], rows], axis=1)
                self.observed[kind] = rows[:, -keep:]
        self.capture.clear()

    def _refresh(self) -> None:
        """A chunked-mode eviction point."""
        if self.watches_queries:
            self._keep_observed()
        self._evict_to_budget()

    def generate(
        self,
        n_predict: int,
        on_text: Callable[[str], None] | None = None,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> tuple[list[int], str]:
        """Sample up to n_predict tokens after what was fed, decoding each into the cache.
        Returns the generated tokens and why generation stopped."""
        out: list[int] = []
        stream = self.model.text_stream()
        t0 = time.perf_counter()
        stopped = "length"
        since_refresh = 0
        every = 1 if self.policy.refresh_every_token else self.chunk
        watching = self.policy.continuous and self.watches_queries
        try:
            while len(out) < n_predict:
                if interrupted():
                    stopped = "interrupted"
                    break
                if self.cache.n_resident >= self.cap or self.cache.free <= 0:
                    stopped = "context full"
                    break
                if self._next_logits is not None:
                    token, self._next_logits = self.sampler.sample_logits(self._next_logits), None
                else:
                    token = self.ctx.sample(self.sampler)
                if self.model.is_eog(token):
                    stopped = "eog"
                    break
                out.append(token)
                if on_text:
                    on_text(stream.push(token))
                # Decoded even when it is the last one: the cache then holds the whole reply,
                # which the next chat turn continues from.
                if watching:  # the queries of the tokens before the next refresh
                    self.capture.enabled = every - since_refresh <= self.policy.observed_tokens()
                self.cache.append([token], logits="last")
                self.timings.decode_tokens += 1
                since_refresh += 1
                if self.policy.continuous and since_refresh >= every:
                    self._refresh()
                    since_refresh = 0
        finally:
            if watching:
                self.capture.enabled = False
            self.timings.decode_s += time.perf_counter() - t0
            if on_text:
                on_text(stream.flush())
        return out, stopped

    def mark(self) -> Mark:
        return Mark(dataclasses.replace(self.timings), self.cache.evicted, self.workspace_forward_passes)

    def timings_since(self, since: Mark | None = None) -> dict:
        return (self.timings - since.timings if since else self.timings).as_dict()

    def cache_report(self, n_prompt: int, since: Mark | None = None) -> dict:
        """kv_bytes: the K and V bytes the resident cells take (a sliding layer's at most its window's).
        since: count evictions and workspace passes from that mark on (one request of a conversation)."""
        since = since or Mark(Timings(), 0, 0)
        kept = self.kept_positions if self.kept_positions is not None else self.cache.positions()
        info, cells = self.model.info, self.cache.n_resident
        layer_cells = len(info.full_layers) * cells + len(info.swa_layers) * min(cells, info.n_swa or cells)
        return {
            "budget": self.policy.budget,
            "n_ctx": self.cap,
            "max_cells": self.cache.max_cells,
            "final_cells": self.cache.n_resident,
            "evicted": self.cache.evicted - since.evicted,
            "kept_positions": [int(p) for p in kept if p < n_prompt],
            "workspace_forward_passes": self.workspace_forward_passes - since.workspace_forward_passes,
            "kv_buffers": self.ctx.kv_buffers,
            "type_k": self.ctx.type_k,
            "type_v": self.ctx.type_v,
            "kv_bytes": layer_cells * self.ctx.layer_cell_bytes,
        }
