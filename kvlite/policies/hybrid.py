"""The chat hybrid (kvlite's own, issue 11): a turn that carries no question (a pasted document,
"read this") is compressed by KVzip's query-agnostic reconstruction score, since the questions it
must serve have not been asked; a turn that asks something by EchoKV's lookahead, whose queries
come from the answer being written. Which kind a turn is comes from Observation.question (set by
the chat; unknown counts as a question, as in a single prompt)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from .kvzip import KVzip
from .lookahead import EchoKV
from .observe import Observation


@dataclasses.dataclass
class Hybrid(EchoKV, KVzip):
    name = "hybrid"
    reads = "kvzip's scores for a document turn, echokv's for a question, over {layers}"
    captures: ClassVar[tuple[str, ...]] = ("q", "q_pre", "k")

    def lookahead_cells(self) -> int:
        return max(EchoKV.lookahead_cells(self), KVzip.lookahead_cells(self))

    def scores_depend_on_budget(self) -> bool:
        return EchoKV.scores_depend_on_budget(self) or KVzip.scores_depend_on_budget(self)

    def scores(self, obs: Observation) -> np.ndarray:
        if obs.question is False:
            obs.method = "hybrid: kvzip reconstruction"
            return self.reconstruction_scores(obs)
        obs.method = "hybrid: echokv lookahead"
        return EchoKV.scores(self, obs)
