"""What a policy is: what it observes and how it scores. Everything else (protection, selection,
eviction, compaction, the lookahead mechanics) is shared and lives in kvlite.selection,
kvlite.cache and kvlite.policies.observe."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..errors import KvliteError

if TYPE_CHECKING:
    from .observe import Observation


MODES = ("prefill-end", "chunked")


@dataclasses.dataclass
class Policy:
    """budget: cells kept on the live sequence after an eviction, protected ones included
    (None: keep everything). sinks: the first positions, always kept. window: the most recent
    resident tokens, always kept (0: only the last one)."""

    budget: int | None = None
    sinks: int = 4
    window: int = 0
    # "prefill-end": evict once, when the prompt (or a chat turn) has been read.
    # "chunked": refresh every chunk of prompt and every `chunk` generated tokens whenever the
    # cache exceeds the budget (the counter-causal paper's cache J), so memory is bounded by
    # budget + chunk whatever the prompt length.
    mode: str = "prefill-end"

    name: ClassVar[str] = ""
    refresh_every_token: ClassVar[bool] = False  # chunked: also refresh after every generated token

    @property
    def continuous(self) -> bool:
        return self.mode == "chunked"

    # What the runner must capture while the prompt is read: the queries of its last
    # `observed_tokens()` tokens, and/or the hidden states entering the last layer.
    needs_hidden: ClassVar[bool] = False

    def observed_tokens(self) -> int:
        return 0

    def lookahead_cells(self) -> int:
        """Cells the policy's lookahead decodes on the workspace need beside the prompt."""
        return 0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise KvliteError(f"--mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if self.continuous and self.budget is None and self.name != "full":
            raise KvliteError("chunked mode needs a cache size: --cache J (or --budget)")
        if self.sinks < 0 or self.window < 0:
            raise KvliteError(f"--sinks and --window must be >= 0, got {self.sinks} and {self.window}")
        if self.budget is None:
            return
        if self.budget <= self.sinks + max(self.window, 1):
            raise KvliteError(
                f"--budget {self.budget} leaves no room beside {self.sinks} sinks and a recent window of "
                f"{max(self.window, 1)}: use a budget above {self.sinks + max(self.window, 1)}"
            )

    def scores_depend_on_budget(self) -> bool:
        """False when the scores are the same at every budget (only the cut moves), so an evaluation
        may score a prompt once and cut it at several budgets."""
        return False

    def scores(self, obs: Observation) -> np.ndarray:
        """One score per resident live position (obs.positions); higher is kept first."""
        raise NotImplementedError
