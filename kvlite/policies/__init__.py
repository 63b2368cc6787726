"""Eviction policies, registered by name."""

from __future__ import annotations

from typing import Any

from ..errors import KvliteError
from .attention import H2O, TOVA, DapQ, SnapKV
from .base import Param, Policy, param
from .baselines import FullKV, StreamingLLM
from .hybrid import Hybrid
from .knorm import KNorm
from .kvzip import KVzip
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
        KNorm,
        KVzip,
        Hybrid,
    )
}


def make_policy(name: str, **params: Any) -> Policy:
    """A policy by name with its parameters (field names; None means the policy's default). A
    parameter the policy does not have is an error that names the ones it has."""
    cls = POLICIES.get(name)
    if cls is None:
        raise KvliteError(f"unknown policy '{name}': choose from {', '.join(POLICIES)}")
    declared = cls.params()
    unknown = sorted(k for k, v in params.items() if k not in declared and v is not None)
    if unknown:
        spelled = ", ".join(f"{k} ({ALL_PARAMS[k].spelling})" if k in ALL_PARAMS else k for k in unknown)
        takes = ", ".join(f"{n} ({p.spelling})" for n, p in declared.items())
        raise KvliteError(f"policy {name} has no parameter {spelled}: it takes {takes}")
    policy = cls(**{k: v for k, v in params.items() if v is not None})
    policy.validate()
    return policy


def check_budget(name: str, budget: int | None, policy_flag: str = "--policy", budget_flag: str = "--budget N") -> None:
    """Every policy but the full cache evicts to a budget, so one must be given. Checked before the
    policy is made, so that this is what a user hears first (each surface names its own flags)."""
    if name in POLICIES and name != "full" and budget is None:
        raise KvliteError(f"{policy_flag} {name} needs {budget_flag} (KV cells to keep)")


def _all_params() -> dict[str, Param]:
    """Every policy parameter once, by field name, in the order policies declare them. A field
    shared by several policies has one declaration (its flag is shared)."""
    out: dict[str, Param] = {}
    for cls in POLICIES.values():
        for name, p in cls.params().items():
            if name in out and (out[name].flag, out[name].alias) != (p.flag, p.alias):
                raise AssertionError(f"parameter {name} is declared twice with different flags")
            out.setdefault(name, p)
    return out


ALL_PARAMS = _all_params()


def parameter_table() -> str:
    """docs/policies.md's parameter table, generated from the declarations."""
    rows = ["| flag | spec alias | values | what | default per policy |", "|---|---|---|---|---|"]
    for name, p in ALL_PARAMS.items():
        flag = f"`{p.short}`, `{p.flag}`" if p.short else f"`{p.flag}`"
        if p.choices:
            values = ", ".join(p.choices)
        else:
            values = f">= {p.minimum:g}" if p.minimum is not None else "any"
            values = f"{p.minimum:g}..{p.maximum:g}" if p.maximum is not None and p.minimum is not None else values
            values += ", odd or 0" if p.odd else ""
            values += ", or a share of the prompt (2%)" if p.share else ""
        rows.append(f"| {flag} | `{p.alias or name}` | {values} | {p.help} | {default_summary(name)} |")
    return "\n".join(rows)


def default_summary(name: str) -> str:
    """Which policies have parameter `name`, with their defaults: "dapq, laq: 16; echokv: 24"."""
    defaults: dict = {}
    for cls in POLICIES.values():
        if name in cls.params():
            defaults.setdefault(cls.defaults()[name], []).append(cls.name)
    everyone = len(defaults) == 1 and len(next(iter(defaults.values()))) == len(POLICIES)
    return "; ".join(("all" if everyone else ", ".join(names)) + f": {'none' if d is None else d}"
                     for d, names in defaults.items())  # fmt: skip


__all__ = [
    "H2O", "LAQ", "POLICIES", "TOVA", "CounterCausal", "CounterCausalBlind", "CounterCausalFast", "DapQ", "EchoKV",
    "FullKV", "Hybrid", "KNorm", "KVzip", "Param", "Policy", "SnapKV", "StreamingLLM", "make_policy", "param",
    "parameter_table", "check_budget",
]  # fmt: skip
