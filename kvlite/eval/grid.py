"""An evaluation grid: models x samples (generated tasks or LongBench files) x policies x budgets.

Every finished (model, task, sample, policy, budget) is one JSON line appended to the output
directory at once, so an interrupted grid resumes where it stopped and a failed cell costs only
itself. Shards take every n-th sample and write their own file; the summary reads them all."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import sys
import time
from collections.abc import Callable, Iterator

from ..engine import Model
from ..errors import KvliteError
from ..evict import GRID_DEFAULT, evict_mode
from ..limits import Budget, cells_for
from ..models import resolve_model
from . import longbench, multiturn, ruler, tasks
from .evaluate import Prompt, Reference, SampleRun, tokenize
from .gridconfig import GridConfig, shard_of
from .records import prepare_out, read_records, record_key, repair_tail
from .specs import kv_type_of, model_label, parse_spec, policy_for, run_params


def _reference_name(label: str, prompt: Prompt) -> str:
    """A saved reference's file name: what the full cache's continuation depends on."""
    key = json.dumps([label, prompt.sample.task, prompt.sample.id, prompt.tokens, prompt.max_new_tokens])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _keep(reference: Reference | None, path: pathlib.Path) -> None:
    """Save a sample's reference for a resume; a disk that cannot take it only costs that resume
    the full cache's prefill again."""
    with contextlib.suppress(OSError):
        if reference is not None:
            reference.save(path)


def _message(e: Exception) -> str:
    """Our errors say what to do; anything else is named by its type."""
    return str(e) if isinstance(e, KvliteError) else f"{type(e).__name__}: {e}"


class Grid:
    def __init__(self, cfg: GridConfig, log=None):
        cfg.validate()
        self.cfg = cfg
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.shard, self.n_shards = shard_of(cfg.shard)
        self._ruler_made: dict[pathlib.Path, list[list[tasks.Sample]]] = {}  # start() makes them, units() reads
        suffix = "" if self.n_shards == 1 else f".shard-{self.shard}-of-{self.n_shards}"
        self.out = cfg.out_dir
        self.samples_path = self.out / f"samples{suffix}.jsonl"
        self.errors_path = self.out / f"errors{suffix}.jsonl"
        self.failures = 0
        evicting = [p for p in cfg.policies if parse_spec(p)[0] != "full"]
        self.cells = [("full", None)] + [(p, b) for p in evicting for b in cfg.budgets]
        valid = [policy_for(p, cells_for(b, cfg.nominal_length), 1) for p, b in self.cells if self._valid(p, b)]
        self.tail = max([1] + [p.observed_tokens() for p in valid])  # prompt tokens every cell feeds itself
        self.lookahead_cells = max([8] + [p.lookahead_cells() for p in valid])

    def _valid(self, spec: str, budget: Budget | None) -> bool:
        try:
            policy_for(spec, cells_for(budget, self.cfg.nominal_length), 1)  # any question length: the spec alone
            return True
        except KvliteError:
            return False

    def _samples(self, model: Model, made: list[list[tasks.Sample]]) -> Iterator[tasks.Sample]:
        """This shard's samples: every n-th of the grid's list, in a fixed order. made: RULER's, one
        list a task and length (generated before the model is loaded: a length a task cannot reach
        fails at once)."""
        cfg = self.cfg
        listed: list[tasks.Sample] = []
        for path in cfg.data:  # every line good: GridConfig.validate
            samples, _ = longbench.load(path, cfg.dataset, cfg.metric)
            listed.extend(samples[: cfg.limit] if cfg.limit else samples)
        count = lambda text: len(model.tokenize(text, add_special=False, parse_special=False))  # noqa: E731
        made = [tasks.generate(t, cfg.n, length, count, cfg.seed, cfg.depth, cfg.split)
                for t in cfg.tasks for length in cfg.lengths] + made  # fmt: skip
        # sample i of every task and length before sample i + 1 of any: a grid stopped early (a long
        # stage carried over sessions) has every task, not the first task's samples alone
        listed.extend(s for row in zip(*made) for s in row)
        for i, s in enumerate(listed):
            if i % self.n_shards == self.shard - 1:
                yield s

    def _fail(self, where: dict, message: str) -> None:
        self.failures += 1
        named = " ".join(f"{k}={v}" for k, v in where.items())
        self.log(f"kvlite eval: {named}: {message}")
        self._append(self.errors_path, {**where, "error": message})

    def _append(self, path: pathlib.Path, record: dict) -> None:
        """One whole line per record, flushed: a kill leaves at most a partial last line, which the
        next run drops (repair_tail) and whose cell it runs again."""
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def start(self) -> set:
        """Ready the output directory; the keys of the cells already recorded there. RULER's samples
        are generated first: a length a task cannot reach leaves no output directory behind."""
        for model_arg in self.cfg.models:
            self._ruler(resolve_model(None if model_arg == "default" else model_arg))
        prepare_out(self.out)
        for path in (self.samples_path, self.errors_path):
            if repair_tail(path):
                self.log(
                    f"kvlite eval: dropped a partial last line of {path} (an interrupted write); its cell runs again"
                )
        return {record_key(r) for r in read_records(self.out)}

    def units(self) -> Iterator[tuple[pathlib.Path, Model, str, tasks.Sample]]:
        """The units of work, (model, sample): all of a sample's cells share its prefill."""
        for model_arg in self.cfg.models:
            path = resolve_model(None if model_arg == "default" else model_arg)
            made = self._ruler(path)
            model = Model(path, n_gpu_layers=self.cfg.n_gpu_layers)
            try:
                for kv_type in self.cfg.kv_types:
                    for sample in self._samples(model, made):
                        yield path, model, model_label(path, kv_type), sample
            finally:
                model.close()

    def _ruler(self, path: pathlib.Path) -> list[list[tasks.Sample]]:
        """RULER's samples for a model, a list a task and length (generated once, then kept in
        kvlite's cache folder: ruler.generate; read once a run)."""
        if path not in self._ruler_made:
            generated = [ruler.generate(self.cfg.ruler, self.cfg.n, n, path, self.cfg.seed) if self.cfg.ruler else {}
                         for n in self.cfg.lengths]  # fmt: skip
            self._ruler_made[path] = [by_task[t] for t in self.cfg.ruler for by_task in generated]
        return self._ruler_made[path]

    def recorder(self, progress=None) -> Callable[[tuple], None]:
        """Where a unit's events go: ("record", r) and ("error", where, message) to the output
        files, ("progress", n) to the progress bar."""

        def emit(event: tuple) -> None:
            if event[0] == "record":
                self._append(self.samples_path, event[1])
            elif event[0] == "error":
                self._fail(event[1], event[2])
            elif progress:
                progress(event[1])

        return emit

    def run(self, progress=None) -> None:
        """Run every unfinished cell of this shard, here. progress(n) is called per cell done."""
        done = self.start()
        emit = self.recorder(progress)
        for _, model, label, sample in self.units():
            self.run_unit(model, label, sample, done, emit)

    def todo(self, label: str, sample: tasks.Sample, done: set) -> tuple[list, bool]:
        """A unit's cells not yet recorded, and whether its diagnostics are still wanted."""
        cfg = self.cfg
        todo = [(p, b) for p, b in self.cells if (label, sample.task, sample.id, p, b) not in done]
        diag_key = (label, sample.task, sample.id, "diagnostics", cfg.diagnostics_budget)
        return todo, cfg.diagnostics and bool(sample.evidence) and diag_key not in done

    def run_unit(
        self,
        model: Model,
        label: str,
        sample: tasks.Sample,
        done: set,
        emit: Callable[[tuple], None],
        keep_reference: bool = True,
    ) -> None:
        """One sample's unfinished cells, replayed from one prefill; what happens goes to emit.
        keep_reference: save the full cache's reference under out/references while the other cells
        run, for a resume (not on a Ray worker: its unit's records reach the driver at its end)."""
        cfg = self.cfg
        base = {"model": label, "task": sample.task, "sample": sample.id, "split": sample.split,
                "kv_type": kv_type_of(label)}  # fmt: skip
        todo, want_diag = self.todo(label, sample, done)
        if not todo and not want_diag:
            return
        if sample.turns is not None:
            self._run_conversations(model, base, sample, todo, emit)
            return
        try:
            prompt = tokenize(model, sample, cfg.n_predict, cfg.max_length)
            run = SampleRun(model, prompt, self.tail, cfg.threads, extra_ctx=self.lookahead_cells,
                            kv_type=base["kv_type"])  # fmt: skip
            saved = self.out / "references" / f"{_reference_name(label, prompt)}.npz" if keep_reference else None
            rerun_full = bool(todo) and todo[0] != ("full", None)
            if rerun_full and saved and (stored := Reference.load(saved)) is not None:
                run.reference, rerun_full = stored, False  # a resume left with chunked cells alone reads no prefix
            if run.reference is None:
                run.prefix()  # read now: a sample that cannot be read fails alone, not once per cell
        except Exception as e:  # noqa: BLE001 - a sample that cannot be read fails alone
            emit(("error", base, _message(e)))
            emit(("progress", len(todo)))
            return
        if rerun_full:
            todo.insert(0, ("full", None))  # the reference for fidelity, rerun after a resume
        prefix_told = False
        for i, (spec, budget) in enumerate(todo):
            where = {**base, "policy": spec, "budget": budget}
            emitted = not (rerun_full and i == 0)  # a resume's rerun of the full cell is not written
            try:
                t0 = time.perf_counter()
                cells = cells_for(budget, len(prompt.tokens))
                policy = policy_for(spec, cells, prompt.question_tokens)
                # (a spec with recall never comes here: multi-turn tasks only, GridConfig.validate)
                record = run.cell(policy, reuse=spec, evolution=cfg.evolution, **run_params(spec))
                if isinstance(budget, str):
                    record["budget_cells"] = cells
                if emitted and not prefix_told and run.prefix_s is not None:
                    # on the first record written after the read (a loaded reference leaves the
                    # read to a later cell), so every read of a prompt is charged once
                    record["time"]["prefix_s"], prefix_told = run.prefix_s, True
                if cells is not None and cells >= len(prompt.tokens):
                    record["note"] = "budget >= prompt: nothing evicted"
                record["time"]["cell_s"] = time.perf_counter() - t0
                if emitted:
                    emit(("record", {**where, **record, "evidence": prompt.evidence}))
                if spec == "full" and saved and len(todo) > 1:
                    _keep(run.reference, saved)  # for the other cells, should this run stop before them
            except Exception as e:  # noqa: BLE001 - a failing cell is reported and the grid goes on
                emit(("error", where, _message(e)))
            if emitted:
                emit(("progress", 1))
        if saved:
            with contextlib.suppress(OSError):
                saved.unlink(missing_ok=True)
                saved.parent.rmdir()  # fails, harmlessly, while another shard's reference is there
        if want_diag:
            where = {**base, "policy": "diagnostics", "budget": cfg.diagnostics_budget}
            try:
                diag = run.overlap(cfg.diagnostics_budget, workspace=cfg.diagnostics_workspace)
                emit(("record", {**where, "overlap": diag}))
            except Exception as e:  # noqa: BLE001
                emit(("error", where, _message(e)))

    def _run_conversations(self, model: Model, base: dict, sample: tasks.Sample, todo: list, emit) -> None:
        """Multi-turn cells: each replays the conversation from its document read once (kvlite.eval.multiturn)."""
        try:
            kv_type = base["kv_type"]
            document = multiturn.read_document(model, sample, self.tail, self.cfg.threads, kv_type)
            memo: dict = {}
        except Exception as e:  # noqa: BLE001 - a sample that cannot be read fails alone
            emit(("error", base, _message(e)))
            emit(("progress", len(todo)))
            return
        for spec, budget in todo:
            where = {**base, "policy": spec, "budget": budget}
            try:
                policy = policy_for(spec, budget)
                run = run_params(spec)
                evict = evict_mode(run.get("evict"), policy, GRID_DEFAULT)
                record = multiturn.run_conversation(model, sample, policy, evict, self.cfg.threads, document,
                                                    (memo, spec), kv_type, run.get("recall", 0),
                                                    run.get("recall_lookahead"))  # fmt: skip
                emit(("record", {**where, **record}))
            except Exception as e:  # noqa: BLE001 - a failing cell is reported and the grid goes on
                emit(("error", where, _message(e)))
            emit(("progress", 1))

    def count_todo(self) -> int:
        """Cells left in this shard (for the progress bar), without loading a model."""
        done = {record_key(r) for r in read_records(self.out)} if self.out.exists() else set()
        return max(0, self._planned() - len([k for k in done if k[3] != "diagnostics"]))

    def _planned(self) -> int:
        cfg = self.cfg
        n_data = 0
        for path in cfg.data:
            rows = sum(1 for line in pathlib.Path(path).read_bytes().split(b"\n") if line.strip())
            n_data += min(rows, cfg.limit) if cfg.limit else rows
        n_samples = n_data + (len(cfg.tasks) + len(cfg.ruler)) * len(cfg.lengths) * cfg.n
        mine = len(range(self.shard - 1, n_samples, self.n_shards))
        return mine * len(self.cells) * len(cfg.models) * len(cfg.kv_types)
