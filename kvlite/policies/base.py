"""What a policy is: what it observes and how it scores. Everything else (protection, selection,
eviction, compaction, the lookahead mechanics) is shared and lives in kvlite.selection,
kvlite.cache and kvlite.policies.observe.

A policy's parameters are dataclass fields declared with `param(...)`: the flag, the eval-spec
alias, the help and the allowed range live there, once. The CLI's flags, the eval-spec parser,
validation and the parameter table in docs/policies.md are generated from them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..errors import KvliteError
from ..limits import INT32_MAX, Budget, cells_for, check_pool_kernel, parse_budget

if TYPE_CHECKING:
    from ..models import ModelInfo
    from .observe import Observation


MODES = ("prefill-end", "chunked")


@dataclasses.dataclass(frozen=True)
class Param:
    """One policy parameter as users see it. flag: the CLI spelling (--pool-kernel); short: a
    llama.cpp-style short flag (-T); alias: the short name in eval specs (echokv(kernel=13));
    minimum / maximum / choices / odd: the allowed values (odd: an odd number, or 0); an integer's
    maximum is at most llama.cpp's int32 range (limits.INT32_MAX); share: a share of the prompt
    ("2%") is allowed too (the budget)."""

    flag: str
    help: str
    type: type = int
    short: str | None = None
    alias: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    odd: bool = False
    share: bool = False

    @property
    def spelling(self) -> str:
        return self.short or self.flag

    def check(self, value: Any) -> None:
        """A one-line error naming the flag when value is out of range."""
        if value is None:
            return
        if self.share and isinstance(value, str):
            parse_budget(value, self.spelling)
            return
        if self.choices is not None:
            if value not in self.choices:
                raise KvliteError(f"{self.spelling} must be one of {', '.join(self.choices)}, got '{value}'")
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (self.type is int and not (math.isfinite(value) and value == int(value))):
            raise KvliteError(f"{self.spelling} must be {'an integer' if self.type is int else 'a number'}, got "
                              f"'{value}'")  # fmt: skip
        if not math.isfinite(value):
            raise KvliteError(f"{self.spelling} must be a finite number, got {value}")
        if self.minimum is not None and value < self.minimum:
            raise KvliteError(f"{self.spelling} must be >= {self.minimum:g}, got {value}")
        maximum = INT32_MAX if self.type is int and self.maximum is None else self.maximum
        if maximum is not None and value > maximum:
            raise KvliteError(f"{self.spelling} must be <= {maximum:g}, got {value}")
        if self.odd:
            check_pool_kernel(self.spelling, value)

    def parse(self, text: str) -> Any:
        """A value from text (an eval spec or a flag)."""
        if self.share:
            return parse_budget(text, self.spelling)
        if self.type is str:
            return text
        try:
            return self.type(text)
        except ValueError:
            raise KvliteError(
                f"{self.spelling} wants {'an integer' if self.type is int else 'a number'}, got '{text}'"
            ) from None


def param(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A policy field with its user-facing declaration (Param)."""
    return dataclasses.field(default=default, metadata={"param": Param(flag, help, **kw)})


@dataclasses.dataclass
class Policy:
    """budget: cells kept on the live sequence after an eviction, protected ones included
    (None: keep everything), or a share of the prompt ("2%": resolve() turns it into cells once the
    prompt is known; the defaults worked out from the budget wait until then). sinks: the first
    positions, always kept. window: the most recent resident tokens, always kept (0: only the last
    one)."""

    budget: Budget | None = param(None, "--budget", "KV cells kept after eviction, sinks included, or a share of "
                                  "the prompt (2%)", minimum=1, share=True)  # fmt: skip
    sinks: int = param(4, "--sinks", "first positions always kept (attention sinks)", minimum=0)
    window: int = param(0, "--window", "most recent tokens always kept (0: h2o keeps budget/2, snapkv its "
                        "observation window, the others the last token)", minimum=0)  # fmt: skip
    # "prefill-end": evict once, when the prompt (or a chat turn) has been read.
    # "chunked": refresh every chunk of prompt and every `chunk` generated tokens whenever the
    # cache exceeds the budget (the counter-causal paper's cache J), so memory is bounded by
    # budget + chunk whatever the prompt length.
    mode: str = param("prefill-end", "--mode", "evict once after the prompt, or refresh every chunk (prefill and "
                      "decode)", type=str, choices=MODES)  # fmt: skip

    name: ClassVar[str] = ""
    # What the scores are computed from, for `kvlite info`; {layers}: the layers scored on a model
    reads: ClassVar[str] = ""
    refresh_every_token: ClassVar[bool] = False  # chunked: also refresh after every generated token
    # How a default that the policy works out (a None field) reads in help and docs, by field name
    default_notes: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if isinstance(self.budget, str):
            self.budget = parse_budget(self.budget, self.flag("budget"))
        if not self.share:
            self.derive()

    def derive(self) -> None:
        """Defaults worked out from other fields (H2O's window, the lookahead's workspace): a
        subclass's None field filled in, once the budget is in cells."""

    @property
    def share(self) -> bool:
        """Whether the budget is a share of the prompt, not yet cells."""
        return isinstance(self.budget, str)

    def resolve(self, n_prompt: int) -> Policy:
        """This policy for an n_prompt-token prompt: a share of it in cells (rounded down, as
        kvpress's presses do), checked as a budget in cells is."""
        if not self.share:
            return self
        cells = cells_for(self.budget, n_prompt)
        try:
            policy = dataclasses.replace(self, budget=cells)
            policy.validate()
        except KvliteError as e:
            kept = f"{cells} cell{'s' * (cells != 1)}"
            raise KvliteError(f"{self.budget} of the {n_prompt}-token prompt is {kept}: {e}") from None
        return policy

    def require_cells(self, what: str, flag: str = "--budget") -> None:
        """A one-line error where a budget must be in cells: a conversation's turns are not one prompt."""
        if self.share:
            raise KvliteError(f"{what} needs {flag} in KV cells (256), not {self.budget}: a share of the prompt is "
                              "for one prompt (kvlite generate, /v1/completions, kvlite eval)")  # fmt: skip

    @classmethod
    def params(cls) -> dict[str, Param]:
        """Every parameter of this policy by field name. A subclass that only changes a default
        (`pool_kernel: int = 0`) keeps the declaration of the class that introduced the field."""
        out = {}
        for f in dataclasses.fields(cls):
            for klass in cls.__mro__:
                declared = getattr(klass, "__dataclass_fields__", {}).get(f.name)
                if declared is not None and "param" in declared.metadata:
                    out[f.name] = declared.metadata["param"]
                    break
        return out

    @classmethod
    def flag(cls, name: str) -> str:
        """How users spell parameter `name` (for messages): -T, --workspace..."""
        return cls.params()[name].spelling

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: cls.default_notes.get(f.name, f.default) for f in dataclasses.fields(cls)}

    @classmethod
    def scores_on(cls, info: ModelInfo) -> str:
        """What this policy scores on the model `info` describes."""
        if not info.swa_layers:
            return cls.reads.format(layers=f"all {info.n_layer} layers")
        full, n_swa = info.full_layers, len(info.swa_layers)
        return cls.reads.format(layers=f"the {len(full)} global layers ({', '.join(map(str, full))}; the {n_swa} "
                                f"others see only the last {info.n_swa} positions)")  # fmt: skip

    def check_model(self, info: ModelInfo) -> None:
        """A one-line error, before any work, where this policy cannot score on the model."""

    @property
    def continuous(self) -> bool:
        return self.mode == "chunked"

    # What the runner must capture while the prompt is read: the queries of its last
    # `observed_tokens()` tokens, and/or the hidden states entering the last layer. captures: the
    # kinds (kvlite.engine.capture.KINDS) captured for observed and workspace tokens.
    needs_hidden: ClassVar[bool] = False
    captures: ClassVar[tuple[str, ...]] = ("q", "q_pre")

    def observed_tokens(self) -> int:
        return 0

    @property
    def observes_queries(self) -> bool:
        """Whether the runner captures queries of the tokens read last for this policy."""
        return (self.observed_tokens() > 0 or self.lookahead_cells() > 0) and not self.needs_hidden

    def lookahead_cells(self) -> int:
        """Cells the policy's lookahead decodes on the workspace need beside the prompt."""
        return 0

    def validate(self) -> None:
        """Every declared range, then what relates parameters to each other (subclasses add theirs)."""
        for name, p in self.params().items():
            p.check(getattr(self, name))
        if self.continuous and self.budget is None and self.name != "full":
            raise KvliteError("chunked mode needs a cache size: --cache J (or --budget)")
        if self.budget is None or self.share:  # a share is checked in cells by resolve()
            return
        if self.budget <= self.sinks + max(self.window, 1):
            raise KvliteError(
                f"{self.flag('budget')} {self.budget} leaves no room beside {self.sinks} sinks and a recent window of "
                f"{max(self.window, 1)}: use a budget above {self.sinks + max(self.window, 1)}"
            )

    def scoring_key(self) -> tuple:
        """Every parameter but selection's (budget, sinks, window): cells of one policy at other
        budgets whose keys are equal score a prompt alike (when the scores do not depend on the budget)."""
        return (self.name, *((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                             if f.name not in ("budget", "sinks", "window")))  # fmt: skip

    def scores_depend_on_budget(self) -> bool:
        """False when the scores are the same at every budget (only the cut moves), so an evaluation
        may score a prompt once and cut it at several budgets."""
        return False

    def scores(self, obs: Observation) -> np.ndarray:
        """One score per resident live position (obs.positions); higher is kept first."""
        raise NotImplementedError
