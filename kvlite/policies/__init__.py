"""Eviction policies, registered by name."""

from __future__ import annotations

from ..errors import KvliteError
from .attention import H2O, TOVA, DapQ, SnapKV
from .base import Policy
from .baselines import FullKV, StreamingLLM
from .lookahead import LAQ, EchoKV
from .surprise import CounterCausal, CounterCausalBlind, CounterCausalFast

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FullKV,
        StreamingLLM,
        H2O,
        TOVA,
        SnapKV,
        DapQ,
        LAQ,
        EchoKV,
        CounterCausal,
        CounterCausalFast,
        CounterCausalBlind,
    )
}


def make_policy(name: str, **params) -> Policy:
    """A policy by name; parameters a policy does not have are ignored (CLI flags are shared)."""
    import dataclasses

    cls = POLICIES.get(name)
    if cls is None:
        raise KvliteError(f"unknown policy '{name}': choose from {', '.join(POLICIES)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    policy = cls(**{k: v for k, v in params.items() if k in fields and v is not None})
    policy.validate()
    return policy


__all__ = [
    "H2O", "LAQ", "POLICIES", "TOVA", "CounterCausal", "CounterCausalBlind", "CounterCausalFast", "DapQ", "EchoKV",
    "FullKV", "Policy", "SnapKV", "StreamingLLM", "make_policy",
]  # fmt: skip
