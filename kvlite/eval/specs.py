"""Policy specs, as a grid names its cells: "echokv(T=8,aggregate=mean)" is a policy and its
parameters, plus the settings of the cell itself (chunked mode's refresh interval, the chat's
eviction mode, a protected question), and the model labels of records."""

from __future__ import annotations

import pathlib
import re

from ..errors import KvliteError
from ..evict import MODES
from ..limits import Budget
from ..policies import POLICIES, FullKV, Param, Policy, make_policy

# Policy parameters in specs such as "echokv(T=8,aggregate=mean)" go by their declared alias, field
# name or flag (kvlite.policies.base.Param). Spec parameters that set up the cell rather than the
# policy: `h` (chunk, chunked mode's refresh interval; default limits.DEFAULT_CHUNK), and
# `window=question`, which protects the sample's closing question (every token from its start on;
# or the policy's own recent window if that is longer), as kvpress's protocol never compresses it.
RUN_PARAMS = {
    "h": ("chunk", Param("h", "chunked mode's refresh interval", minimum=1)),
    "chunk": ("chunk", Param("h", "chunked mode's refresh interval", minimum=1)),
    # multi-turn tasks: the chat's eviction mode (kvlite chat --evict; a spec without it: GRID_DEFAULT)
    "evict": ("evict", Param("evict", "chat eviction mode", type=str, choices=MODES)),
    # multi-turn tasks: evicted cells a turn brings back (kvlite chat --recall; default 0, none)
    "recall": ("recall", Param("recall", "evicted cells a chat turn brings back", minimum=0)),
    # ... and whether recall scores with an eager eviction's lookahead queries too (1) or not (0;
    # default evict.RECALL_LOOKAHEAD)
    "recall_lookahead": (
        "recall_lookahead",
        Param("recall_lookahead", "recall with lookahead queries", minimum=0, maximum=1),
    ),
}
RUN_FIELDS = tuple(dict.fromkeys(field for field, _ in RUN_PARAMS.values()))  # chunk, evict, recall, ...
QUESTION = "question"


_SPEC = re.compile(r"\s*([\w-]+)\s*(?:\((.*)\))?\s*")  # name(key=value,...): the one way a spec is read


def spec_name(spec: str) -> str:
    """ "echokv(T=8)" -> "echokv" (the text before the parameters, as written)."""
    m = _SPEC.fullmatch(spec)
    return m.group(1) if m else spec.partition("(")[0].strip()


def spec_items(spec: str) -> dict[str, str]:
    """ "echokv(T=8,B1=512)" -> {"T": "8", "B1": "512"}: the parameters as written, unparsed."""
    m = _SPEC.fullmatch(spec)
    items = (item.partition("=") for item in filter(None, ((m and m.group(2)) or "").split(",")))
    return {k.strip(): v.strip() for k, _, v in items}


def with_param(spec: str, param: str) -> str:
    """spec with one more parameter ("name=value")."""
    return f"{spec[:-1]},{param})" if spec.endswith(")") else f"{spec}({param})"


def without_param(spec: str, name: str) -> str:
    """spec less its parameter `name`."""
    kept = [f"{k}={v}" for k, v in spec_items(spec).items() if k != name]
    return f"{spec_name(spec)}({','.join(kept)})" if kept else spec_name(spec)


def parse_spec(spec: str) -> tuple[str, dict]:
    """ "echokv(T=8,aggregate=mean)" -> ("echokv", {"lookahead": 8, "aggregation": "mean"})."""
    m = _SPEC.fullmatch(spec)
    if not m or m.group(1) not in POLICIES:
        raise KvliteError(f"unknown policy '{spec}': choose from {', '.join(POLICIES)} (parameters as name(T=8))")
    declared = POLICIES[m.group(1)].params()
    names = {**{p.flag.lstrip("-"): n for n, p in declared.items()}, **{n: n for n in declared},
             **{p.alias: n for n, p in declared.items() if p.alias}}  # fmt: skip
    params: dict = {}
    for item in filter(None, (m.group(2) or "").split(",")):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise KvliteError(f"policy '{spec}': parameters are key=value, got '{item}'")
        if key in RUN_PARAMS:
            field, prm = RUN_PARAMS[key]
            params[field] = prm.parse(value)
            prm.check(params[field])
        elif names.get(key) == "window" and value == QUESTION:
            params["window"] = QUESTION
        elif key in names:
            params[names[key]] = declared[names[key]].parse(value)
        else:
            known = ", ".join([p.alias or n for n, p in declared.items()] + ["h", *RUN_FIELDS[1:]])
            raise KvliteError(f"policy '{spec}' has no parameter {key}: its parameters are {known}")
    return m.group(1), params


def split_policies(text: str) -> list[str]:
    """Comma-separated specs; commas inside parentheses belong to a spec."""
    return [p.strip() for p in re.findall(r"[^,(]+(?:\([^)]*\))?", text) if p.strip()]


def policy_for(spec: str, budget: int | None, question_tokens: int | None = None) -> Policy:
    """Grids evict once, when the prompt has been read (as kvpress and the papers' LongBench runs do),
    unless a spec says mode=chunked. question_tokens: the sample's closing question's length in
    tokens, for specs with window=question (None: unknown, and such a spec is refused)."""
    name, params = parse_spec(spec)
    if "budget" in params:
        raise KvliteError(f"policy '{spec}': a grid's budgets are its --budgets axis, not a spec parameter")
    params.setdefault("mode", "prefill-end")
    for run_param in RUN_FIELDS:
        params.pop(run_param, None)
    protect = params.get("window") == QUESTION
    if protect:
        if question_tokens is None:
            raise KvliteError(f"'{spec}': this sample has no known question to protect")
        del params["window"]
    if name == "full":
        return FullKV()
    policy = make_policy(name, budget=budget, **params)
    if protect:  # in addition to the policy's own recent window (H2O's is half the budget)
        policy.window = max(policy.window, question_tokens)
        policy.validate()
    return policy


def run_params(spec: str) -> dict:
    """The cell settings a spec carries (chunk h for chunked mode; evict and recall for multi-turn
    tasks)."""
    return {k: v for k, v in parse_spec(spec)[1].items() if k in RUN_FIELDS}


def budget_order(budget: Budget | None) -> tuple:
    """The full cache first, then budgets in cells, then shares, each ascending."""
    if budget is None:
        return (0, 0.0)
    return (2, float(budget[:-1])) if isinstance(budget, str) else (1, float(budget))


def model_label(path: pathlib.Path, kv_type: str = "f16") -> str:
    """A record's model: the file, and the cache type when it is not the default (its own table)."""
    return path.stem if kv_type == "f16" else f"{path.stem} [{kv_type} cache]"


def kv_type_of(label: str) -> str:
    m = re.search(r" \[(\w+) cache\]$", label)
    return m.group(1) if m else "f16"
