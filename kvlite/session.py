"""A model, a context sized for a policy, and the loop that feeds tokens, evicts and generates."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from .cache import KVCache
from .engine import Context, Model, Sampler, SamplingParams
from .errors import KvliteError
from .policies import FullKV, Policy
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
    if policy.continuous and policy.budget is not None:
        if not n_ctx:
            return policy.budget + chunk, chunk
        return n_ctx, min(chunk, n_ctx - policy.budget)
    need = n_tokens + max(n_predict, 0)
    if not n_ctx:
        return max(need, 16), chunk
    if n_tokens > n_ctx:
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


class Session:
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
    ):
        self.model = model
        self.policy = policy or FullKV()
        self.policy.validate()
        self.chunk = chunk
        self.ctx = Context(model, n_ctx, n_batch=chunk, n_threads=n_threads, flash_attn=flash_attn)
        self.cache = KVCache(self.ctx)
        self.sampling = sampling or SamplingParams()
        self.sampler = Sampler(self.sampling)
        self.timings = Timings()
        self._compact_due = False
        self.kept_positions: np.ndarray | None = None

    def close(self) -> None:
        self.sampler.close()
        self.ctx.close()

    # -- eviction -------------------------------------------------------------------------------
    def _evict_to_budget(self) -> None:
        budget = self.policy.budget
        if budget is None or self.cache.n_resident <= budget:
            return
        t0 = time.perf_counter()
        positions = self.cache.positions()
        keep = select_keep(
            positions,
            self.policy.scores(self.cache),
            budget,
            protected_positions(positions, self.policy.sinks),
        )
        if self.cache.evict(keep):
            self._compact_due = True
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
        """Prefill tokens in chunks, evicting after each chunk for continuous policies. Returns
        False if interrupted (the tokens fed so far stay)."""
        if not tokens:
            raise KvliteError("nothing to feed: the prompt is empty")
        t0 = time.perf_counter()
        try:
            for start in range(0, len(tokens), self.chunk):
                if interrupted():
                    return False
                piece = tokens[start : start + self.chunk]
                self.cache.append(piece, logits="last")
                self.timings.prefill_tokens += len(piece)
                if self.policy.continuous:
                    self._evict_to_budget()
                if progress:
                    progress(len(piece))
            self._evict_to_budget()
            self._compact()
            return True
        finally:
            self.timings.prefill_s += time.perf_counter() - t0
            self.kept_positions = self.cache.positions()

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
        try:
            while len(out) < n_predict:
                if interrupted():
                    stopped = "interrupted"
                    break
                if self.cache.n_resident >= self.ctx.n_ctx:
                    stopped = "context full"
                    break
                token = self.sampler.sample(self.ctx.ptr, -1)
                if self.model.is_eog(token):
                    stopped = "eog"
                    break
                out.append(token)
                if on_text:
                    on_text(stream.push(token))
                # Decoded even when it is the last one: the cache then holds the whole reply,
                # which the next chat turn continues from.
                self.cache.append([token], logits="last")
                self.timings.decode_tokens += 1
                if self.policy.continuous:
                    self._evict_to_budget()
        finally:
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
        }
