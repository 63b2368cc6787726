"""RULER (issue 60): kvlite's samples are what NVIDIA's packaged RULER generates, run through its own
prepare.py, for the same seed and the model's tokenizer; each task's answers are what its prompt
says (counted here, independently of the generators); RULER's metrics; RULER-format --data lines;
a length a task cannot reach is a one-line error, not RULER's endless retry."""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import run_cli

from kvlite.errors import KvliteError
from kvlite.eval import longbench, ruler
from kvlite.eval.metrics import score

pytestmark = pytest.mark.slow
LENGTH = 2048  # RULER's qa tasks need ~1.7K tokens for their smallest sample (10 documents)
TASKS = ["niah_single_1", "niah_multikey_3", "niah_multivalue", "vt", "cwe", "fwe", "qa_1"]
# RULER's tokenizer interface on the GGUF vocabulary, for RULER's own prepare.py: its scripts know
# NeMo, HF, tiktoken and Gemini tokenizers (none offline), so the one line they cannot run as is
SITECUSTOMIZE = """
import sys
if any("long_context_eval" in a for a in sys.argv):
    import nltk.tokenize
    import long_context_eval.data.tokenizer as t
    from kvlite.engine import Model

    class Vocab:
        def __init__(self, path):
            self.model = Model(path, vocab_only=True)

        def text_to_tokens(self, text):
            return self.model.tokenize(text, add_special=False, parse_special=False)

    t.select_tokenizer = lambda kind, path: Vocab(path)
    sys.modules["tokenizer"] = t  # the scripts that import it as a top-level module
    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        nltk.tokenize.sent_tokenize = nltk.tokenize.PunktSentenceTokenizer().tokenize
"""


@pytest.fixture(scope="module")
def ruler_cache(tmp_path_factory):
    """A cache folder of this module's own, so that its samples are generated here, not read back."""
    return tmp_path_factory.mktemp("kvlite-cache")


@pytest.fixture(scope="module")
def generated(smol_path, ruler_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLITE_CACHE", str(ruler_cache))
        return ruler.generate(TASKS, 2, LENGTH, smol_path)


def test_generated_samples_are_kept_and_read_back(generated, smol_path, ruler_cache, monkeypatch):
    """A second start (a resume, another policy on the same samples) reads RULER's lines back from
    the cache folder rather than running the generators for a minute again."""
    monkeypatch.setenv("KVLITE_CACHE", str(ruler_cache))
    assert len(list((ruler_cache / "ruler").glob(f"*-{LENGTH}-n2-seed42-*.jsonl"))) == len(TASKS)
    monkeypatch.setattr(ruler, "_run", lambda *_: pytest.fail("the generators ran again"))
    assert ruler.generate(TASKS, 2, LENGTH, smol_path) == generated


def test_the_task_table_is_the_packages():
    import long_context_eval
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as BASE
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    root = pathlib.Path(long_context_eval.__file__).parent
    configs = yaml.safe_load((root / "synthetic.yaml").read_text())
    assert tuple(configs) == ruler.TASKS
    for task, config in configs.items():
        kind = ruler.family(task)
        assert kind == config["task"] and ruler.N_PREDICT[kind] == BASE[kind]["tokens_to_generate"]
        assert ruler.METRIC[kind] == METRICS[kind]["metric_fn"].__name__


def test_samples_are_rulers_own_prepare_output(generated, smol_path, tmp_path):
    """RULER's prepare.py, as its users run it (base template), with the model's tokenizer: the same
    prompts (kvlite's user part and answer prefix together), answers and lengths."""
    import long_context_eval

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    prepare = pathlib.Path(long_context_eval.__file__).parent / "data" / "prepare.py"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "PATH": f"{pathlib.Path(sys.executable).parent}:"
           f"{os.environ['PATH']}"}  # fmt: skip
    for task in ("niah_multivalue", "cwe", "qa_1"):
        subprocess.run([sys.executable, str(prepare), "--save_dir", str(tmp_path / "out"), "--task", task,
                        "--tokenizer_path", smol_path, "--tokenizer_type", "kvlite", "--max_seq_length", str(LENGTH),
                        "--num_samples", "2"], env=env, check=True, capture_output=True)  # fmt: skip
        rows = [json.loads(line) for line in (tmp_path / "out" / task / "validation.jsonl").open()]
        assert len(rows) == 2, f"RULER's prepare.py wrote nothing for {task}"
        for row, sample in zip(rows, generated[task], strict=True):
            assert sample.prompt + sample.cue == row["input"]
            assert sample.answers == row["outputs"]


def test_answers_are_what_the_prompts_say(generated, smol_model):
    count = lambda text: len(smol_model.tokenize(text, add_special=False, parse_special=False))  # noqa: E731
    for task, samples in generated.items():
        assert [s.id for s in samples] == [0, 1] and len({s.prompt for s in samples}) == 2
        for s in samples:
            assert s.task == f"ruler:{task}/{LENGTH}" and s.split == "ruler" and s.chat
            assert s.max_new_tokens == ruler.N_PREDICT[ruler.family(task)]
            text, question = s.prompt, s.prompt[s.question[0] :]
            tokens = count(text + s.cue) + s.max_new_tokens
            if task != "fwe":  # fwe fills its text to the length, then adds its generation (RULER's own)
                assert 0.7 * LENGTH < tokens <= LENGTH, (task, tokens)
            if task.startswith("niah"):
                keys = re.findall(r"for (\S+?)(?:,|\s+mentioned)", question)
                for key in keys:  # every value stated for the asked keys, and no other
                    stated = re.findall(rf"One of the special magic \w+ for {re.escape(key)} is: (\S+)\.", text)
                    assert stated and set(stated) <= set(s.answers)
                assert len(s.answers) == (4 if task == "niah_multivalue" else 1)
            elif task == "vt":
                value = re.search(r"assigned the value (\d+)", question).group(1)
                chain, frontier = set(), {value}
                while frontier:  # follow VAR X = Y assignments from the value
                    frontier = set(re.findall(rf"VAR (\w+) = (?:VAR )?(?:{'|'.join(frontier)})\b", text)) - chain
                    chain |= frontier
                assert chain == set(s.answers)
            elif task == "cwe":
                listed = re.findall(r"\d+\. (\S+)", text.rpartition("Below is a numbered list")[2])
                top = [w for w, _ in collections.Counter(listed).most_common(10)]
                assert set(top) == set(s.answers)
            elif task == "fwe":
                words = [w for w in text.split() if re.fullmatch(r"[a-z]{6}", w)]
                assert [w for w, _ in collections.Counter(words).most_common(3)] == s.answers
            else:
                assert any(a in text for a in s.answers)


def test_rulers_metrics():
    answers = ["5661907", "3608513", "4612365", "6647119"]
    assert score("string_match_all", "5661907 and 3608513", answers) == 0.5
    assert score("string_match_all", " ".join(answers), answers) == 1.0
    assert score("string_match_part", "it is FRANCE.", ["France", "Paris"]) == 1.0
    assert score("string_match_part", "Italy", ["France", "Paris"]) == 0.0


def test_a_length_a_task_cannot_reach_is_one_line(smol_path):
    with pytest.raises(KvliteError, match=r"qa_2 cannot fit a sample in 992 tokens: its smallest is \d+"):
        ruler.generate(["qa_2"], 1, 1024, smol_path)
    with pytest.raises(KvliteError, match="unknown RULER task 'niah'"):
        ruler.generate(["niah"], 1, 1024, smol_path)


def test_ruler_format_data_lines(tmp_path):
    (tmp_path / "niah_single_1").mkdir()
    own = tmp_path / "niah_single_1" / "validation.jsonl"  # where RULER's prepare.py writes it
    own.write_text(json.dumps({"index": 0, "input": "text. The number is", "outputs": ["7"], "length": 9}) + "\n")
    (sample,), errors = longbench.load(own)
    assert not errors and (sample.task, sample.metric, sample.max_new_tokens, sample.chat, sample.cue) == (
        "ruler_niah_single_1", "string_match_all", 128, False, None)  # fmt: skip
    mine = tmp_path / "mine.jsonl"
    lines = [{"input": "Which city?", "outputs": ["Oslo"], "metric": "string_match_part", "n_predict": 8,
              "template": "chat", "answer_prefix": " Answer:"},
             {"dataset": "ruler_qa_1", "input": "q", "outputs": ["a"]},
             {"input": "q", "outputs": ["a"]},
             {"input": None, "outputs": ["a"], "dataset": "ruler_vt"},
             {"input": "q", "outputs": {"a": 1}, "dataset": "ruler_vt"},
             {"input": "q", "outputs": ["a"], "metric": "bleu", "n_predict": 8},
             {"input": "q", "outputs": ["a"], "metric": "string_match_all", "n_predict": 0},
             {"input": "q", "outputs": ["a"], "dataset": "ruler_vt", "template": "instruction"}]  # fmt: skip
    mine.write_text("".join(json.dumps(x) + "\n" for x in lines))
    samples, errors = longbench.load(mine)
    assert [(s.task, s.metric, s.max_new_tokens, s.chat, s.cue) for s in samples] == [
        ("mine", "string_match_part", 8, True, " Answer:"),
        ("ruler_qa_1", "string_match_part", 32, False, None),
    ]
    expected = [
        "a RULER line needs its task as dataset ruler_<task>",
        "field input must be a string, got null",
        "field outputs must be a non-empty list of strings, got an object",
        "unknown metric 'bleu'",
        "field n_predict must be in 1..",
        'field template must be "base" or "chat", got \'instruction\'',
    ]
    assert len(errors) == len(expected)
    for lineno, (error, wanted) in enumerate(zip(errors, expected, strict=True), 3):
        assert error.startswith(f"{mine}:{lineno}: {wanted}")


def test_eval_ruler_end_to_end(smol_path, tmp_path):
    r = run_cli("eval", "--ruler", "vt,cwe", "--lengths", "1024", "-n", "1", "-m", smol_path,
                "--policies", "full,streaming", "--budgets", "64", "--out", str(tmp_path), "--json", "--no-plots",
                timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(row["task"], row["policy"], row["budget"]) for row in rows} == {
        (f"ruler:{t}/1024", p, b) for t in ("vt", "cwe") for p, b in (("full", None), ("streaming", 64))
    }
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").open()]
    assert {r["split"] for r in records} == {"ruler"} and all(0 <= r["score"] <= 1 for r in records)
