"""An evaluation grid's configuration: the TOML file and the flags over it, each option's type and
range checked before any model work (kvlite eval's one boundary for them)."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
import types
import typing

from ..engine.cachetypes import CACHE_TYPES
from ..errors import KvliteError
from ..evict import check_recall, evict_mode
from ..limits import INT32_MAX, cells_for, check_int, check_threads, parse_budget
from . import longbench, ruler, tasks
from .specs import parse_spec, policy_for, run_params

DEFAULT_TASKS = ["single", "multikey", "twohop"]


@dataclasses.dataclass
class GridConfig:
    models: list[str] = dataclasses.field(default_factory=lambda: ["default"])
    tasks: list[str] | None = None  # generated tasks; None: DEFAULT_TASKS unless `data` or `ruler` is given
    ruler: list[str] = dataclasses.field(default_factory=list)  # RULER's tasks (kvlite.eval.ruler), at `lengths`
    lengths: list[int] = dataclasses.field(default_factory=lambda: [1024])
    n: int = 4  # samples per generated task and length
    seed: int = 0
    depth: float | None = None
    split: str = "tune"  # generated tasks' prose and phrasing (tasks.PHRASINGS): tune, or test for reports
    data: list[str] = dataclasses.field(default_factory=list)  # LongBench-format JSONL files
    dataset: str | None = None
    metric: str | None = None
    limit: int = 0  # at most this many samples per data file (0: all)
    policies: list[str] = dataclasses.field(default_factory=lambda: ["full", "streaming", "snapkv", "echokv"])
    budgets: list[int | str] = dataclasses.field(default_factory=lambda: [128, 256])  # cells, or "25%" of a prompt
    kv_types: list[str] = dataclasses.field(default_factory=lambda: ["f16"])  # cache types, K and V alike (-ctk/-ctv)
    n_predict: int | None = None  # overrides each task's generation length
    max_length: int = 0  # longer prompts keep their first and last halves (0: the model's context)
    diagnostics: bool = False  # EchoKV Table 1 overlap per generated sample
    evolution: bool = False  # chunked cells record the positions kept at every refresh (cache-evolution plots)
    diagnostics_budget: int = 128
    diagnostics_workspace: int = 256
    threads: int | None = None
    n_gpu_layers: int | None = None  # -ngl (None: all layers on a GPU build)
    shard: str = "1/1"
    out: str = "eval-out"
    ray: str | None = None  # run the units on Ray: a cluster's address, or "local" (kvlite eval --ray)
    ray_retries: int = 3  # how often a unit whose worker died is tried again elsewhere

    @classmethod
    def load(cls, path: str | pathlib.Path | None, overrides: dict) -> GridConfig:
        """A TOML file's keys (dashes or underscores) overridden by the CLI's non-None values."""
        values: dict = {}
        if path is not None:
            try:
                raw = tomllib.loads(pathlib.Path(path).read_bytes().decode("utf-8"))
            except OSError as e:
                raise KvliteError(f"cannot read config file {path}: {e.strerror or e}") from None
            except UnicodeDecodeError as e:
                raise KvliteError(f"{path} is not valid UTF-8 (byte {e.start}): TOML files are UTF-8") from None
            except tomllib.TOMLDecodeError as e:
                raise KvliteError(f"{path}: not valid TOML ({e})") from None
            values = {k.replace("-", "_"): v for k, v in raw.items()}
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise KvliteError(f"unknown config key(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
        hints = typing.get_type_hints(cls)
        for key, value in values.items():
            if not _is(value, hints[key]):
                raise KvliteError(f"config key {key} must be {_describe_type(hints[key])}, got {value!r}")
        cfg = cls(**values)
        cfg.validate()
        if not cfg.tasks and not cfg.data and not cfg.ruler:  # (a Ray worker's has none: its samples come with it)
            raise KvliteError("--tasks names no task and there is no --data or --ruler: nothing to evaluate")
        return cfg

    def validate(self) -> None:
        """Every value in range, the same words whatever gave it (flag, TOML key, Python): a grid
        that would run nothing, or run something else than asked, is refused before any work."""
        if not self.policies:
            raise KvliteError("--policies names no policy")
        for spec in self.policies:
            parse_spec(spec)
        if not self.kv_types:
            raise KvliteError("--kv-types names no cache type")
        for t in self.kv_types:
            if t not in CACHE_TYPES:
                raise KvliteError(f"--kv-types {t!r}: the cache types are {', '.join(CACHE_TYPES)}")
        self.budgets = [parse_budget(b, "--budgets") for b in self.budgets]
        for flag, values in (("--policies", self.policies), ("--budgets", self.budgets), ("--kv-types", self.kv_types),
                             ("--lengths", self.lengths), ("--tasks", self.tasks or []), ("--ruler", self.ruler),
                             ("--data", self.data)):  # fmt: skip
            twice = sorted({str(v) for v in values if values.count(v) > 1})
            if twice:  # each would run, and record, the same cells again
                raise KvliteError(f"{flag} names {', '.join(twice)} twice")
        evicting = [p for p in self.policies if parse_spec(p)[0] != "full"]
        if evicting and not self.budgets:
            raise KvliteError(f"--budgets names no budget: {', '.join(evicting)} need one")
        for spec in evicting:  # a spec no budget can run is refused; one some budgets cannot fails its cells
            errors = []
            for b in self.budgets:
                try:
                    evict_mode(run_params(spec).get("evict"), policy_for(spec, cells_for(b, self.nominal_length), 1))
                    break
                except KvliteError as e:
                    errors.append(e)
            else:
                raise KvliteError(f"--policies {spec}: {errors[0]}")
        for n in self.lengths:
            check_int("--lengths", n, tasks.MIN_LENGTH)
        check_int("-n", self.n)
        check_int("--seed", self.seed, -INT32_MAX)
        check_int("--max-length", self.max_length)
        check_int("--limit", self.limit)
        if self.n_predict is not None:
            check_int("--n-predict", self.n_predict, 1)  # a cell scores what it generates
        if self.depth is not None and not 0 <= self.depth <= 1:  # NaN fails it too
            raise KvliteError(f"--depth must be in 0..1 (a share of the prompt), got {self.depth}")
        check_int("diagnostics_budget", self.diagnostics_budget, 1)
        check_int("diagnostics_workspace", self.diagnostics_workspace, 1)
        if self.threads is not None:
            check_threads("-t", self.threads)
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise KvliteError(f"-ngl must be 0 or more layers, got {self.n_gpu_layers}")
        check_int("ray_retries", self.ray_retries)
        if self.split not in tasks.SPLITS:
            raise KvliteError(f"--split must be one of {', '.join(tasks.SPLITS)}, got '{self.split}'")
        if self.tasks is None:
            self.tasks = [] if self.data or self.ruler else list(DEFAULT_TASKS)
        for t in self.tasks:
            if tasks.task_kind(t)[0].multi_turn and any(isinstance(b, str) for b in self.budgets):
                raise KvliteError(f"--tasks {t}: a conversation's budget is in cells (a share needs one prompt)")
        single = self.data or self.ruler or [t for t in self.tasks if not tasks.task_kind(t)[0].multi_turn]
        for spec in self.policies:
            run = run_params(spec)
            if "recall_lookahead" in run and not run.get("recall"):
                raise KvliteError(f"--policies {spec}: recall_lookahead chooses recall's queries: give recall=N too")
            if run.get("recall"):
                if single:
                    raise KvliteError(f"--policies {spec}: recall brings cells back to a conversation's next turn: "
                                      "multi-turn tasks only (--tasks chat)")  # fmt: skip
                check_recall(run["recall"], policy_for(spec, None, 1), f"--policies {spec}: recall")
            if "evict" in run and single:  # a single prompt evicts once it is read, whatever the mode
                raise KvliteError(f"--policies {spec}: evict chooses when a conversation evicts: multi-turn tasks "
                                  "only (--tasks chat)")  # fmt: skip
        for t in self.ruler:
            ruler.family(t)
        if self.ruler:
            ruler.check_installed()
        if (self.tasks or self.ruler) and not self.lengths:
            raise KvliteError("--lengths names no length for the generated tasks")
        if (self.tasks or self.ruler) and not self.n:
            raise KvliteError("-n 0 generates no sample: give -n 1 or more")
        shard_of(self.shard)
        if self.dataset is not None:
            longbench.check_dataset(self.dataset)
        for path in self.data:
            samples, errors = longbench.load(path, self.dataset, self.metric)
            if errors:
                more = f" (and {len(errors) - 1} more line(s))" if len(errors) > 1 else ""
                raise KvliteError(f"{errors[0]}{more}: fix or remove them")
            if not samples:
                raise KvliteError(f"data file {path} holds no line: nothing to evaluate")
        if pathlib.Path(self.out).exists() and not pathlib.Path(self.out).is_dir():
            raise KvliteError(f"--out {self.out} is a file: name a directory (new or from an earlier run)")

    @property
    def nominal_length(self) -> int:
        """The prompt length a share budget is judged at before any prompt is read (the longest
        generated; a data file's prompts are as long as they are)."""
        return max(self.lengths, default=tasks.MIN_LENGTH)

    @property
    def out_dir(self) -> pathlib.Path:
        return pathlib.Path(self.out)


def _is(value: object, hint) -> bool:
    """Whether a config value has its field's type (list[int], str | None, ...); an int for a float."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_is(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe_type(hint) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in args)
    if typing.get_origin(hint) is list:
        return "a list of " + {int: "integers", str: "strings"}.get(args[0], "values")
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, "none")


def shard_of(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise KvliteError(f"--shard must look like i/n with 1 <= i <= n, got '{text}'")
    return int(m.group(1)), int(m.group(2))
