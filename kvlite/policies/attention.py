"""Policies that score cached tokens by the attention some queries pay them (EchoKV Eq. 3 pooling
per layer and KV group, then aggregated to one score per token)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..scoring.aggregate import METHODS
from .base import Policy, param
from .observe import Observation, Queries


def observation_param(default: int):
    return param(default, "--observation", "last prompt queries whose attention scores the cache", minimum=1)


MAX_LOOKAHEAD = 1024  # the papers look 8-32 tokens ahead; thousands would be a generation of its own per eviction


def lookahead_param(default: int):
    return param(default, "--lookahead", "lookahead steps: future positions (dapq) or greedy workspace forward "
                 "passes (laq, echokv)", short="-T", alias="T", minimum=1, maximum=MAX_LOOKAHEAD)  # fmt: skip


def pool_kernel_param(default: int):
    return param(default, "--pool-kernel", "max-pool smoothing of attention scores (odd; 0 = none)", alias="kernel",
                 minimum=0, odd=True)  # fmt: skip


def anchors_param(default: int):
    return param(default, "--anchors", "last prompt queries rotated into proposals (S)", alias="S", minimum=1)


@dataclasses.dataclass
class AttentionPolicy(Policy):
    """aggregation: how per-(layer, KV group) scores become one per token (mean, max, votes);
    pool_kernel: SnapKV's max-pool smoothing over neighbouring tokens (odd, 0 = none)."""

    aggregation: str = param("max", "--aggregate", "per-(layer, KV group) scores to one per token",
                             type=str, alias="aggregate", choices=METHODS)  # fmt: skip
    pool_kernel: int = pool_kernel_param(7)

    def scores_depend_on_budget(self) -> bool:
        return self.aggregation == "votes"  # votes count top-budget memberships

    def score_queries(self, obs: Observation, queries: Queries) -> np.ndarray:
        return obs.token_scores(queries, self.aggregation, self.pool_kernel, self.budget or 1)


@dataclasses.dataclass
class LastQueries(AttentionPolicy):
    """Scores by the attention of the last `observation` queries of what was fed."""

    observation: int = observation_param(32)

    def observed_tokens(self) -> int:
        return self.observation

    def scores(self, obs: Observation) -> np.ndarray:
        return self.score_queries(obs, obs.last_queries(self.observation))


@dataclasses.dataclass
class SnapKV(LastQueries):
    """SnapKV (Li et al., 2024): the last 32 prompt queries, smoothed by a max-pool of 7; the
    observation window itself is kept (window defaults to it)."""

    name = "snapkv"
    reads = "the attention of the last prompt queries over the cached keys of {layers}, max-pooled"

    def derive(self) -> None:
        self.window = self.window or self.observation


@dataclasses.dataclass
class TOVA(LastQueries):
    """TOVA (Oren et al., 2024): the attention of the last token only."""

    name = "tova"
    reads = "the attention of the last token's query over the cached keys of {layers}"
    observation: int = 1
    pool_kernel: int = 0


@dataclasses.dataclass
class H2O(LastQueries):
    """H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus a recent window of
    half the budget. H2O sums the attention of every query; kvlite has no full prefill attention
    matrix and keeps no running sum, so at an eviction point it sums that of the last 32 prompt
    queries (the pooling kernel, as every attention policy; docs/policies.md)."""

    name = "h2o"
    reads = "the attention the last prompt queries paid each cached key of {layers}, accumulated"
    pool_kernel: int = 0
    aggregation: str = "mean"

    def derive(self) -> None:
        self.window = self.window or (self.budget // 2 if self.budget else 0)


@dataclasses.dataclass
class DapQ(AttentionPolicy):
    """DapQ proposals alone (EchoKV's stage 1): the last `anchors` pre-RoPE queries rotated to the
    next `lookahead` positions (Eq. 2), pooled over the prompt."""

    name = "dapq"
    reads = "the attention of proposals (the last pre-RoPE queries rotated to future positions) over {layers}"
    lookahead: int = lookahead_param(16)
    anchors: int = anchors_param(1)

    def observed_tokens(self) -> int:
        return self.anchors

    def scores(self, obs: Observation) -> np.ndarray:
        return self.score_queries(obs, obs.proposals(self.anchors, self.lookahead))
