"""The chat hybrid (kvlite's own; docs/policies.md): a turn that carries no question (a pasted document,
"read this") is compressed by KVzip's query-agnostic reconstruction score, since the questions it
must serve have not been asked; a turn that asks something by EchoKV's lookahead, whose queries
come from the answer being written. Which kind a turn is comes from Observation.question (set by
the chat; unknown counts as a question, as in a single prompt).

A composition, not a subclass of both: the hybrid's parameters are its two parts' (declared once,
by them), and each turn is scored by an EchoKV or a KVzip made from them. Each part smooths with
its own kernel: --pool-kernel is the EchoKV part's (its rule when left out), and the KVzip part
keeps KVzip's default, the value measured for its scores (docs/policies.md)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .base import Policy
from .kvzip import KVzip
from .lookahead import EchoKV
from .observe import Observation

if TYPE_CHECKING:
    from ..models import ModelInfo


def _part_field(part: type[Policy], name: str) -> Any:
    """Field `name` of a part, as the part declares it: its default and its Param (flag, alias,
    range and help stay one declaration)."""
    return dataclasses.field(default=part.__dataclass_fields__[name].default,
                             metadata={"param": part.params()[name]})  # fmt: skip


@dataclasses.dataclass
class Hybrid(Policy):
    name = "hybrid"
    reads = "kvzip's scores for a document turn, echokv's for a question, over {layers}"
    captures: ClassVar[tuple[str, ...]] = ("q", "q_pre", "k")
    default_notes: ClassVar[dict[str, str]] = EchoKV.default_notes

    # The parts' parameters, in the order the hybrid has always listed them
    repeat_chunk: int = _part_field(KVzip, "repeat_chunk")
    pair_vote: str = _part_field(KVzip, "pair_vote")
    pool_kernel: int | None = _part_field(EchoKV, "pool_kernel")  # the EchoKV part's (None: its rule)
    aggregation: str = _part_field(EchoKV, "aggregation")
    lookahead: int = _part_field(EchoKV, "lookahead")
    workspace: int | None = _part_field(EchoKV, "workspace")  # the EchoKV part's (None: its rule)
    anchors: int = _part_field(EchoKV, "anchors")
    proposals: int | None = _part_field(EchoKV, "proposals")

    def derive(self) -> None:
        if self.pool_kernel is None:
            self.pool_kernel = self.echokv.pool_kernel
        if self.workspace is None:
            self.workspace = self.echokv.workspace

    def _part(self, cls: type[Policy], own: tuple[str, ...] = ()) -> Any:
        """A part made from the hybrid's fields, but for those it keeps its own default (own)."""
        return cls(**{name: getattr(self, name) for name in cls.params() if name not in own})

    # Made from the hybrid's fields when asked, so that a field set later (an eval grid's
    # window=question) reaches them
    @property
    def echokv(self) -> EchoKV:
        return self._part(EchoKV)

    @property
    def kvzip(self) -> KVzip:
        return self._part(KVzip, own=("pool_kernel",))

    def validate(self) -> None:
        super().validate()
        self.echokv.validate()
        self.kvzip.validate()

    def check_model(self, info: ModelInfo) -> None:
        self.echokv.check_model(info)
        self.kvzip.check_model(info)

    def observed_tokens(self) -> int:
        return max(self.echokv.observed_tokens(), self.kvzip.observed_tokens())

    def lookahead_cells(self) -> int:
        return max(self.echokv.lookahead_cells(), self.kvzip.lookahead_cells())

    def scores_depend_on_budget(self) -> bool:
        return self.echokv.scores_depend_on_budget() or self.kvzip.scores_depend_on_budget()

    def scores(self, obs: Observation) -> np.ndarray:
        if obs.question is False:
            obs.method = "hybrid: kvzip reconstruction"
            return self.kvzip.scores(obs)
        obs.method = "hybrid: echokv lookahead"
        return self.echokv.scores(obs)
