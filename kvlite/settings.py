"""How a model is run, whatever the policy (RunSettings), and the context a run allocates for a
policy (plan_context)."""

from __future__ import annotations

import dataclasses

from .engine import SamplingParams
from .engine.cachetypes import check_types
from .errors import KvliteError
from .limits import DEFAULT_CHUNK, check_int, check_threads
from .policies import Policy

MIN_CTX = 256  # llama.cpp pads a context to a multiple of 256 cells


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How a model is run, whatever the policy: the one object the CLI, the Python API, chat and
    evaluation pass around. n_ctx: context cells, 0 = as needed (plan_context); chunk: the prefill
    batch, and chunked mode's refresh interval h; flash_attn, type_k, type_v: -fa, -ctk, -ctv
    (kvlite.engine.cachetypes)."""

    n_ctx: int = 0
    chunk: int = DEFAULT_CHUNK
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    n_threads: int | None = None
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"

    def __post_init__(self):
        if isinstance(self.n_ctx, int) and self.n_ctx < 0:
            raise KvliteError(f"-c must be >= 0 (0: as needed), got {self.n_ctx}")
        check_int("-c", self.n_ctx)
        check_int("--chunk", self.chunk, 1)
        if self.n_threads is not None:
            check_threads("-t", self.n_threads)
        object.__setattr__(self, "flash_attn", check_types(self.type_k, self.type_v, self.flash_attn))


def check_budget_fits(policy: Policy, n_ctx: int, flag: str = "--budget") -> None:
    """A budget must leave the context room beside it (n_ctx 0: as needed, anything fits)."""
    if isinstance(policy.budget, int) and n_ctx and policy.budget >= n_ctx:  # a share fits where its prompt does
        raise KvliteError(f"{flag} {policy.budget} does not fit in the context (-c {n_ctx}): lower it or raise -c")


def plan_context(policy: Policy, n_ctx: int, n_tokens: int, n_predict: int, chunk: int) -> tuple[int, int]:
    """(context cells, prefill chunk) for a policy.

    n_ctx 0 means "as needed": the whole text for policies that keep everything until the prompt
    ends, budget + chunk for a continuously evicting one (any prompt length then fits)."""
    check_int("--chunk", chunk, 1)  # as RunSettings does, for callers that pass their own
    if 0 < n_ctx < MIN_CTX:
        raise KvliteError(f"-c {n_ctx}: llama.cpp allocates at least {MIN_CTX} cells; use -c 0 (as needed) or "
                          f"-c {MIN_CTX} or more, and --budget to keep fewer")  # fmt: skip
    check_budget_fits(policy, n_ctx)
    extra = policy.lookahead_cells()
    if policy.continuous and policy.budget is not None:
        if not policy.refresh_every_token and chunk > policy.budget:
            raise KvliteError(f"--chunk {chunk} is larger than the cache (--budget/--cache {policy.budget}): lower it")
        if not n_ctx:
            return policy.budget + chunk + extra, chunk
        if n_ctx - policy.budget - extra <= 0:
            raise KvliteError(f"-c {n_ctx} leaves no room for a chunk beside the cache and the lookahead: raise -c")
        return n_ctx, min(chunk, n_ctx - policy.budget - extra)
    need = n_tokens + max(n_predict, 0) + extra
    if not n_ctx:
        return max(need, 16), chunk
    if n_tokens + extra > n_ctx:
        hint = max(n_ctx - chunk, n_ctx // 2)  # room for the budget and a chunk beside it
        raise KvliteError(
            f"the prompt has {n_tokens} tokens and the context {n_ctx}: raise -c or use an evicting policy "
            f"(e.g. --policy streaming --budget {hint})"
        )
    return n_ctx, chunk
