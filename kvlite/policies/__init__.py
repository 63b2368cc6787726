"""Eviction policies, registered by name."""

from __future__ import annotations

from ..errors import KvliteError
from .base import Policy
from .baselines import FullKV, StreamingLLM

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (FullKV, StreamingLLM)}


def make_policy(name: str, **params) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise KvliteError(f"unknown policy '{name}': choose from {', '.join(POLICIES)}")
    policy = cls(**params)
    policy.validate()
    return policy


__all__ = ["POLICIES", "FullKV", "Policy", "StreamingLLM", "make_policy"]
