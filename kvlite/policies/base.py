"""What a policy is: what it observes and how it scores. Everything else (protection, selection,
eviction, compaction) is shared and lives in kvlite.selection and kvlite.cache."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from ..cache import KVCache
from ..errors import KvliteError


@dataclasses.dataclass
class Policy:
    """budget: cells kept on the live sequence after an eviction, protected ones included
    (None: keep everything). sinks: the first positions, always kept."""

    budget: int | None = None
    sinks: int = 4

    name: ClassVar[str] = ""
    # True: evict whenever the cache exceeds the budget, while the prompt is fed (in chunks) and
    # while generating, so memory is bounded by budget + chunk whatever the prompt length.
    continuous: ClassVar[bool] = False

    def validate(self) -> None:
        if self.sinks < 0:
            raise KvliteError(f"--sinks must be >= 0, got {self.sinks}")
        if self.budget is None:
            return
        if self.budget <= self.sinks + 1:
            raise KvliteError(
                f"--budget {self.budget} leaves no room beside {self.sinks} sinks and the last token: "
                f"use a budget above {self.sinks + 1}"
            )

    def scores(self, cache: KVCache) -> np.ndarray:
        """One score per resident live position (cache.positions()); higher is kept first."""
        raise NotImplementedError
