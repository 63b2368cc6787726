"""Policies that need no attention: keep everything, or keep the sinks and the most recent tokens."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import KvliteError
from .base import Policy
from .observe import Observation


@dataclasses.dataclass
class FullKV(Policy):
    """No eviction: the reference every other policy is measured against."""

    name = "full"
    reads = "nothing: every cell is kept"

    def validate(self) -> None:
        if self.budget is not None or self.mode != "prefill-end":
            raise KvliteError("--policy full keeps every cell: it takes no --budget, --cache or --mode chunked "
                              "(for a bounded cache use e.g. --policy streaming --cache 512)")  # fmt: skip
        super().validate()

    def scores(self, obs: Observation) -> np.ndarray:
        return np.zeros(len(obs.positions))


@dataclasses.dataclass
class StreamingLLM(Policy):
    """StreamingLLM (Xiao et al., 2024): attention sinks plus a window of the most recent tokens."""

    name = "streaming"
    reads = "positions only: the sinks and the most recent window"
    mode: str = "chunked"
    refresh_every_token = True  # scoring is free: the window slides token by token

    def scores(self, obs: Observation) -> np.ndarray:
        return obs.positions.astype(np.float64)  # later is better
