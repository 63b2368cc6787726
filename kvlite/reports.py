"""What a run reports: one eviction, the time spent reading, evicting and generating, the counters
at a moment (to report since then), and a generation's result."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Eviction:
    """What one eviction did: the resident positions it scored, their scores, the positions kept,
    the prompt views of its lookahead rounds, its workspace forward passes and the prompt's own
    next-token logits when a lookahead overwrote llama.cpp's."""

    positions: np.ndarray
    scores: np.ndarray
    kept: np.ndarray
    workspace_views: list[np.ndarray]
    workspace_forward_passes: int = 0
    next_logits: np.ndarray | None = None
    method: str = ""  # how the scores were made: the policy's name, or what a policy with several ways chose
    lookahead_queries: list[np.ndarray] = dataclasses.field(default_factory=list)  # its lookahead's [L, H, n, D]


@dataclasses.dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    evict_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recall_s: float = 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prefill_tok_s"] = self.prefill_tokens / self.prefill_s if self.prefill_s else None
        d["decode_tok_s"] = self.decode_tokens / self.decode_s if self.decode_s else None
        return d

    def __sub__(self, other: Timings) -> Timings:
        return Timings(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class Mark:
    """A runner's counters at one moment (Runner.mark): a report since then subtracts them."""

    timings: Timings
    evicted: int
    workspace_forward_passes: int


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
