"""Counter-causal surprise ("Back from the Future"): keep the tokens the later context cannot
predict. Scores from kvlite.scoring.surprise; the last min_gap + 1 tokens are always kept."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..errors import KvliteError
from ..models import ModelInfo
from ..native import counter_causal_unsupported
from ..scoring.surprise import SCORES, SurpriseModel, cache_contents, surprise
from .base import Policy, param
from .observe import Observation


@functools.lru_cache(maxsize=4)
def _surprise_model(info) -> SurpriseModel:
    return SurpriseModel(info)


@dataclasses.dataclass
class CounterCausal(Policy):
    """score: "raw" (the paper's logit of x_i) or "logprob" (normalized across positions);
    min_gap: cells next to a token it may not attend to (the reference code's min_gap)."""

    name = "cc"
    reads = "counter-causal logits: the model's weights run over the cached K/V of {layers}, later cells first"
    variant = "full"
    blind = False
    score: str = param("raw", "--surprise", "raw (the paper's logit of x_i) or logprob (kvlite's normalized one)",
                       type=str, alias="surprise", choices=SCORES)  # fmt: skip
    min_gap: int = param(0, "--min-gap", "nearest later tokens a token may not attend to", minimum=0)

    @classmethod
    def scores_on(cls, info: ModelInfo) -> str:
        if why := counter_causal_unsupported(info):
            return f"not available on {info.arch}: {why}"
        return super().scores_on(info)

    def check_model(self, info: ModelInfo) -> None:
        if why := counter_causal_unsupported(info):
            raise KvliteError(f"{self.name} runs the model's blocks in kvlite's native pass: {why}; use another policy")

    def scores(self, obs: Observation) -> np.ndarray:
        model = _surprise_model(obs.info)
        contents = cache_contents(obs.cache, model, self.variant)
        logits = model.logits(contents, self.variant, self.score, self.min_gap, blind=self.blind)
        return surprise(logits)


@dataclasses.dataclass
class CounterCausalFast(CounterCausal):
    """The single-layer approximation: the last layer only, from the stored hidden states."""

    name = "cc-fast"
    reads = "counter-causal logits of the last layer, from the hidden states entering it and its cached K/V"
    variant = "fast"
    needs_hidden = True


@dataclasses.dataclass
class CounterCausalBlind(CounterCausal):
    """kvlite's own variant, not the paper's: the full pass with every cell's input replaced by a
    neutral embedding (the mean token embedding), queries at the cell's own position, the same
    mask. In the paper's pass x_i is the input at position i, so a model that copies its input
    finds a stated-once number predictable; here x_i must be predicted from the later cells alone."""

    name = "cc-blind"
    reads = "counter-causal logits from the cached K/V of {layers}, every input a neutral embedding"
    blind = True
