"""Policies whose queries come from decoding ahead on a workspace view of the prompt: the queries
of the answer being generated are the ones with a reason to find the evidence (docs/design.md,
"Why lookahead"). Both decode T tokens on the workspace (sequence 1); the live cache is untouched
until eviction."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from ..errors import KvliteError
from .attention import AttentionPolicy, anchors_param, lookahead_param, observation_param
from .base import param
from .observe import Observation

SMALL_BUDGET = 128  # below it EchoKV smooths with LAQ's max-pool of 7 (the tune split at 64 cells)
LONG_CACHE, LONG_PROPOSALS = 16_000, 6  # from LONG_CACHE resident cells EchoKV's default P (the tune split at 16K)
# The smallest budget at which a policy kept answers on the test split (64 cells and 1% of 2K and
# 4K prompts, docs/results.md): under it the CLI says so.
MIN_ANSWERING_BUDGET = 64


@dataclasses.dataclass
class LookaheadPolicy(AttentionPolicy):
    """lookahead (T): greedy workspace steps; workspace (B1): prompt tokens the workspace views."""

    lookahead: int = lookahead_param(16)
    # None: WORKSPACE cells, or the budget when it is larger (a workspace smaller than the budget
    # is refused; above WORKSPACE no workspace size was searched, so it is the smallest that runs)
    workspace: int | None = param(None, "--workspace", "prompt tokens a lookahead workspace views (B1)", alias="B1",
                                  minimum=1)  # fmt: skip
    WORKSPACE: ClassVar[int] = 1024
    default_notes: ClassVar[dict[str, str]] = {"workspace": "1024, or the budget when larger"}

    def derive(self) -> None:
        if self.workspace is None:
            self.workspace = max(self.WORKSPACE, self.budget or 0)

    def validate(self) -> None:
        super().validate()
        if self.budget is not None and not self.share and self.workspace < self.budget:
            w, b = self.flag("workspace"), self.flag("budget")
            raise KvliteError(f"{w} {self.workspace} is smaller than {b} {self.budget}")

    def lookahead_cells(self) -> int:
        return self.lookahead


@dataclasses.dataclass
class LAQ(LookaheadPolicy):
    """LAQ: T greedy steps on a frozen SnapKV workspace (window 32, pooling 7, as LAQ's scripts),
    then the final top-B by the lookahead queries over the whole prompt."""

    name = "laq"
    reads = "the attention of lookahead queries (greedy steps on a SnapKV workspace) over {layers}"
    observation: int = observation_param(32)

    def observed_tokens(self) -> int:
        return self.observation

    def scores(self, obs: Observation) -> np.ndarray:
        snap = obs.token_scores(obs.last_queries(self.observation), self.aggregation, 7, self.workspace)
        look = obs.lookahead(obs.top(snap, self.workspace))
        try:
            queries = look.step(self.lookahead)
        finally:
            look.close()
        return self.score_queries(obs, queries)


@dataclasses.dataclass
class EchoKV(LookaheadPolicy):
    """EchoKV, Algorithm 1: bootstrap W1 from proposals (Eq. 2, 3); round 1, T/2 greedy steps on W1
    (queries Q1); repair, W2 = top-B1 of the whole prompt under Q1 (round-1 tokens stay, so round 2
    continues after them); round 2, T/2 steps on W2 (Q2); final top-B under [Q1; Q2]. T workspace
    forward passes in all, as LAQ."""

    name = "echokv"
    reads = "the attention of proposals, then of lookahead queries on two workspaces, over {layers}"
    # Picked on the tune split by a joint successive-halving search over S, T, smoothing, B1 and
    # aggregation (scripts/pick_defaults.py; docs/results.md, "EchoKV defaults"). S=16, not the
    # paper's 1: with a chat template the last prompt token is a template marker whose query does
    # not point at the evidence (how much of it W1 held: docs/policies.md, the echokv row). S=1 tied
    # on accuracy; the search's tie-break (lower KL) chose 16.
    anchors: int = anchors_param(16)
    lookahead: int = 24
    # None: 13, the search's pick at 128 and 256 cells, or 7 under SMALL_BUDGET cells. A max-pool
    # keeps a centred run of `kernel` cells around each peak; in a small budget, where the closing
    # question holds a third of the cells, runs of 13 cut a code's first digits (docs/policies.md).
    pool_kernel: int | None = None
    WORKSPACE: ClassVar[int] = 512
    # None: each anchor rotated to all T future positions (Eq. 2), or to LONG_PROPOSALS of them
    # from LONG_CACHE resident cells. The proposals' pass, S x P queries over every cached key of
    # every layer, is most of a long prompt's eviction time, and neighbouring positions rotate a
    # query little (docs/cache.md, "Where an eviction's time goes"). The long rule was chosen on the
    # tune split at 16K by a rule written down before it ran (docs/results.md, "EchoKV with fewer
    # proposals"); below it, P = T is what the tune split picked and the test tables report.
    proposals: int | None = param(None, "--proposals", "future positions each anchor is rotated to, spread over "
                                  f"the T (P; none: all T, or {LONG_PROPOSALS} from {LONG_CACHE} cells)", alias="P",
                                  minimum=1)  # fmt: skip
    default_notes: ClassVar[dict[str, str]] = {
        "pool_kernel": f"13, 7 under {SMALL_BUDGET} cells",
        "workspace": "512, or the budget when larger",
        "proposals": f"T, or {LONG_PROPOSALS} from {LONG_CACHE} cells",
    }

    def derive(self) -> None:
        super().derive()
        if self.pool_kernel is None:
            self.pool_kernel = 7 if self.budget is not None and self.budget < SMALL_BUDGET else 13

    def validate(self) -> None:
        super().validate()
        if self.lookahead % 2:
            t = self.flag("lookahead")
            raise KvliteError(f"EchoKV splits {t} into two rounds: it must be even, got {self.lookahead}")
        if self.proposals is not None and self.proposals > self.lookahead:
            p, t = self.flag("proposals"), self.flag("lookahead")
            raise KvliteError(f"{p} picks among the {t} positions: at most {self.lookahead}, got {self.proposals}")

    def observed_tokens(self) -> int:
        return self.anchors

    def bootstrap(self, obs: Observation) -> np.ndarray:
        """W1: the top-B1 prompt positions under the proposals (Eq. 2, 3)."""
        proposals = obs.proposals(self.anchors, self.lookahead, self.proposal_count(len(obs.positions)))
        return obs.top(self.score_queries(obs, proposals), self.workspace)

    def proposal_count(self, n_cells: int) -> int | None:
        """P for an eviction from n_cells resident cells (None: all T)."""
        if self.proposals is not None or n_cells < LONG_CACHE:
            return self.proposals
        return min(LONG_PROPOSALS, self.lookahead)

    def lookahead_queries(self, obs: Observation) -> np.ndarray:
        """[Q1; Q2]: T/2 greedy steps on W1, the repair to W2, T/2 more steps."""
        half = self.lookahead // 2
        look = obs.lookahead(self.bootstrap(obs))
        try:
            q1 = look.step(half)
            look.view(obs.top(self.score_queries(obs, q1), self.workspace))
            q2 = look.step(half)
        finally:
            look.close()
        return np.concatenate([q1, q2], axis=2)

    def scores(self, obs: Observation) -> np.ndarray:
        return self.score_queries(obs, self.lookahead_queries(obs))
