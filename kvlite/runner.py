"""A model, a context sized for a policy, and the loop that feeds tokens, evicts and generates."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from .cache import KVCache, Snapshot
from .engine import Capture, Context, Model, Sampler, SamplingParams
from .errors import KvliteError
from .policies import FullKV, Policy
from .policies.observe import Observation
from .selection import protected_positions, select_keep

DEFAULT_CHUNK = 512


def plan_context(policy: Policy, n_ctx: int, n_tokens: int, n_predict: int, chunk: int) -> tuple[int, int]:
    """(context cells, prefill chunk) for a policy.

    n_ctx 0 means "as needed": the whole text for policies that keep everything until the prompt
    ends, budget + chunk for a continuously evicting one (any prompt length then fits)."""
    if chunk <= 0:
        raise KvliteError(f"--chunk must be positive, got {chunk}")
    if policy.budget is not None and n_ctx and policy.budget >= n_ctx:
        raise KvliteError(f"--budget {policy.budget} does not fit in the context (-c {n_ctx}): lower it or raise -c")
    extra = policy.lookahead_cells()
    if policy.continuous and policy.budget is not None:
        if not policy.refresh_every_token and chunk > policy.budget:
            raise KvliteError(f"--chunk {chunk} is larger than the cache (--budget/--cache {policy.budget}): lower it")
        if not n_ctx:
            return policy.budget + chunk + extra, chunk
        if n_ctx - policy.budget - extra <= 0:
            raise KvliteError(f"-c {n_ctx} leaves no room for a chunk beside the cache and the lookahead: raise -c")
        return n_ctx, min(chunk, n_ctx - policy.budget - extra)
    need = n_tokens + max(n_predict, 0) + extra
    if not n_ctx:
        return max(need, 16), chunk
    if n_tokens + extra > n_ctx:
        raise KvliteError(
            f"the prompt has {n_tokens} tokens and the context {n_ctx}: raise -c or use an evicting policy "
            "(e.g. --policy streaming --budget 512)"
        )
    return n_ctx, chunk


@dataclasses.dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    evict_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prefill_tok_s"] = self.prefill_tokens / self.prefill_s if self.prefill_s else None
        d["decode_tok_s"] = self.decode_tokens / self.decode_s if self.decode_s else None
        return d


@dataclasses.dataclass
class Generation:
    text: str
    prompt_tokens: int
    generated_tokens: int
    stopped: str  # "eog", "length", "context full" or "interrupted"
    cache: dict
    timings: dict

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Runner:
    """Feeds text through one context under one policy. Interrupting (the `interrupted` callable
    returning True) stops between tokens or chunks, never inside llama.cpp, so the cache stays
    consistent."""

    def __init__(
        self,
        model: Model,
        policy: Policy | None = None,
        n_ctx: int = 4096,
        chunk: int = DEFAULT_CHUNK,
        sampling: SamplingParams | None = None,
        n_threads: int | None = None,
        flash_attn: bool = False,
        kv_type: str = "f16",
    ):
        self.model = model
        self.policy = policy or FullKV()
        self.policy.validate()
        self.chunk = chunk
        self.capture = self._capture_for(self.policy)
        # The capture is switched on and off around the tokens whose queries the policy reads
        # (a hidden-state capture stays on: every token's row is kept).
        self.watches_queries = self.capture is not None and not self.policy.needs_hidden
        if self.capture is not None and flash_attn:
            raise KvliteError(f"--policy {self.policy.name} observes attention: drop --flash-attn")
        self.ctx = Context(
            model,
            n_ctx,
            n_batch=chunk,
            n_threads=n_threads,
            flash_attn=flash_attn,
            kv_type=kv_type,
            capture=self.capture,
        )
        hidden_layer = model.info.n_layer - 2 if self.policy.needs_hidden else None
        self.cache = KVCache(self.ctx, hidden_layer=hidden_layer)
        self.observed: dict[str, np.ndarray] = {}  # queries of the last tokens fed, per kind [L, n, H, D]
        self.workspace_forward_passes = 0
        self._next_logits: np.ndarray | None = None  # set when decodes on the workspace overwrote them
        self.sampling = sampling or SamplingParams()
        self.sampler = Sampler(self.sampling)
        self.timings = Timings()
        self._compact_due = False
        self.kept_positions: np.ndarray | None = None
        self.workspace_views: list[np.ndarray] = []  # what the last eviction's lookahead rounds viewed
        self.last_scores: np.ndarray | None = None
        # When a list: the positions resident after each eviction (the cache-evolution picture).
        self.history: list[np.ndarray] | None = None
        # Scores of this very cache from an earlier run of the same policy at another budget
        # (evaluation grids; only for policies whose scores do not depend on the budget).
        self.reuse_scores: np.ndarray | None = None

    def _capture_for(self, policy: Policy) -> Capture | None:
        """Ask llama.cpp only for what the policy observes."""
        n_layer = self.model.info.n_layer
        wants_queries = policy.observed_tokens() > 0 or policy.lookahead_cells() > 0
        if not wants_queries and not policy.needs_hidden:
            return None
        capture = Capture()
        if policy.needs_hidden:
            capture.request("hidden", [n_layer - 2])  # always on: every token's row is kept
        if wants_queries:
            if policy.needs_hidden:
                raise KvliteError("a policy observing both queries and hidden states is not supported yet")
            capture.request("q", range(n_layer))
            capture.request("q_pre", range(n_layer))
            capture.enabled = False  # switched on for the tokens observed
        return capture

    def restore(self, snap: Snapshot) -> None:
        """Start over from a snapshot of a prompt read earlier (in this or another runner)."""
        self.cache.restore(snap)
        self.observed = {}
        self._next_logits = None
        self._compact_due = False
        self.kept_positions = None
        self.workspace_views = []
        self.last_scores = None  # reuse_scores stays: it is meant for this restored prompt
        self.workspace_forward_passes = 0
        self.timings = Timings()
        if self.capture is not None:
            self.capture.clear()

    def close(self) -> None:
        self.sampler.close()
        self.ctx.close()

    # -- eviction -------------------------------------------------------------------------------
    def _evict_to_budget(self) -> None:
        budget = self.policy.budget
        if budget is None or self.cache.n_resident <= budget:
            return
        t0 = time.perf_counter()
        obs = Observation(self)
        if self.reuse_scores is not None:
            if len(self.reuse_scores) != len(obs.positions):
                raise KvliteError("scores to reuse were computed for another cache")
            scores, self.reuse_scores = self.reuse_scores, None
        else:
            try:
                scores = self.policy.scores(obs)
            finally:
                if self.cache.workspace_active:
                    self.cache.workspace_drop()  # lookahead cells never outlive the scoring
            self.workspace_forward_passes += obs.workspace_forward_passes
            self.workspace_views = obs.workspace_views
        self.last_scores = scores
        if obs.next_logits is not None:
            self._next_logits = obs.next_logits
        keep = select_keep(
            obs.positions, scores, budget, protected_positions(obs.positions, self.policy.sinks, self.policy.window)
        )
        if self.cache.evict(keep):
            self._compact_due = True
        if self.history is not None:
            self.history.append(np.asarray(keep))
        self.timings.evict_s += time.perf_counter() - t0

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
    ) -> bool:
        """Prefill tokens in chunks (refreshing after each in chunked mode), then evict to the budget.
        Returns False if interrupted (the tokens fed so far stay)."""
        if not tokens:
            raise KvliteError("nothing to feed: the prompt is empty")
        t0 = time.perf_counter()
        observe_from = len(tokens) - self.policy.observed_tokens() if self.policy.observed_tokens() else len(tokens)
        watching = self.watches_queries
        try:
            for start in range(0, len(tokens), self.chunk):
                if interrupted():
                    return False
                piece = tokens[start : start + self.chunk]
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
            self._evict_to_budget()
            self._compact()
            return True
        finally:
            self.timings.prefill_s += time.perf_counter() - t0
            self.kept_positions = self.cache.positions()

    def _keep_observed(self) -> None:
        """Move the captured queries of the last tokens out of the capture (the policy's window of
        them, older ones included when the newest chunk is shorter than the window)."""
        data = self.capture.data
        n_layer = self.model.info.n_layer
        keep = max(self.policy.observed_tokens(), 1)
        for kind in ("q", "q_pre"):
            if (kind, 0) in data:
                rows = np.stack([np.concatenate(data[(kind, il)]) for il in range(n_layer)])
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
                if self.cache.n_resident >= self.ctx.n_ctx:
                    stopped = "context full"
                    break
                if self._next_logits is not None:
                    token, self._next_logits = self.sampler.sample_logits(self._next_logits), None
                else:
                    token = self.sampler.sample(self.ctx.ptr, -1)
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

    def cache_report(self, n_prompt: int) -> dict:
        kept = self.kept_positions if self.kept_positions is not None else self.cache.positions()
        return {
            "budget": self.policy.budget,
            "n_ctx": self.ctx.n_ctx,
            "max_cells": self.cache.max_cells,
            "final_cells": self.cache.n_resident,
            "evicted": self.cache.evicted,
            "kept_positions": [int(p) for p in kept if p < n_prompt],
            "workspace_forward_passes": self.workspace_forward_passes,
        }
