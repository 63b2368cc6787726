"""LongBench-format data: LongBench's templates and metrics, bad lines named, and a small fixture
(tests/data/longbench_mini.jsonl: four usable lines, one malformed, one unknown dataset) run end to end
through the CLI."""

import csv
import pathlib

from conftest import run_cli

from kvlite.eval import longbench

DATA = pathlib.Path(__file__).parent / "data" / "longbench_mini.jsonl"


def test_loader_uses_longbench_templates_and_names_bad_lines():
    samples, errors = longbench.load(DATA)
    assert [s.task for s in samples] == ["hotpotqa", "trec", "passage_count", "lcc"]
    assert {s.split for s in samples} == {"data"}  # a user's file is neither split: tune.py refuses it
    hotpot = samples[0]
    assert hotpot.prompt.startswith("Answer the question based on the given passages.")
    assert hotpot.prompt.endswith("Question: Which city is the capital of Norway?\nAnswer:")
    assert "Oslo is the capital of Norway." in hotpot.prompt
    assert (hotpot.metric, hotpot.max_new_tokens, hotpot.chat) == ("qa_f1", 32, True)
    trec = samples[1]
    assert (trec.metric, trec.chat, trec.all_classes[2]) == ("classification", False, "City")
    assert samples[2].answers == ["2"] and samples[2].metric == "count"
    assert samples[3].metric == "code_sim" and samples[3].prompt.endswith("Next line of code:\n")
    assert len(errors) == 2
    assert "longbench_mini.jsonl:3: not valid JSON" in errors[0]
    assert "longbench_mini.jsonl:4: unknown LongBench dataset 'narrative_qa_typo'" in errors[1]


def test_first_line_postprocessing():
    samples, _ = longbench.load(DATA)
    assert longbench.postprocess(samples[1], "\nCity\nQuestion: more") == "City"  # trec: first line only
    assert longbench.postprocess(samples[0], "Oslo\nmore") == "Oslo\nmore"


def test_fixture_runs_end_to_end_through_the_cli(tiny_paths, tmp_path):
    argv = ["-m", tiny_paths["llama"], "--policies", "full,streaming", "--budgets", "48", "--n-predict", "4",
            "--out", str(tmp_path)]  # fmt: skip
    r = run_cli("eval", "--data", str(DATA), *argv)
    # two lines could not be used: refused before the model is loaded, the first named
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 1 and line.startswith(f"kvlite: error: {DATA}:3: not valid JSON")
    assert line.endswith("(and 1 more line(s)): fix or remove them")
    assert not tmp_path.joinpath("samples.jsonl").exists()
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"\n".join(line for i, line in enumerate(DATA.read_bytes().split(b"\n"), 1) if i not in (3, 4)))
    r = run_cli("eval", "--data", str(good), *argv)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert {(row["task"], row["policy"], row["budget"], row["n"]) for row in rows} == {
        (t, p, b, "1")
        for t in ("hotpotqa", "trec", "passage_count", "lcc")
        for p, b in (("full", "full"), ("streaming", "48"))
    }
    assert all(0 <= float(row["score"]) <= 1 for row in rows)
    assert (tmp_path / "plots" / "scores-tiny-llama.png").read_bytes()[:4] == b"\x89PNG"
    assert "| streaming |" in (tmp_path / "summary.md").read_text()


def test_bad_metric_and_dataset_are_one_line_errors(tiny_paths, tmp_path):
    r = run_cli("eval", "--data", str(DATA), "-m", tiny_paths["llama"], "--metric", "bleu", "--out", str(tmp_path))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "unknown metric 'bleu'" in r.stderr
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"context": "c", "input": "i", "answers": ["a"]}\n')
    r = run_cli("eval", "--data", str(plain), "--dataset", "hotpot", "-m", tiny_paths["llama"], "--out", str(tmp_path))
    assert r.returncode == 1 and r.stderr.startswith("kvlite: error: unknown LongBench dataset 'hotpot'")  # up front
    r = run_cli("eval", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path))
    assert r.returncode == 1 and "data file not found" in r.stderr


def test_long_prompts_keep_their_first_and_last_halves(tiny_model):
    from kvlite.eval.evaluate import tokenize
    from kvlite.eval.tasks import Sample

    sample = Sample("trec", 1, "HEAD " + "filler " * 200 + " TAIL", ["x"], "qa_f1", 8, chat=False)
    prompt = tokenize(tiny_model, sample, max_length=100)
    assert len(prompt.tokens) == 100
    text = tiny_model.detokenize(prompt.tokens).strip()
    assert text.startswith("HEAD") and text.endswith("TAIL") and "filler" in text
    assert len(tokenize(tiny_model, sample).tokens) > 1000  # the model's context (4096) holds it whole


def test_evidence_follows_its_tokens_when_the_middle_is_cut(tiny_model):
    """A generated prompt longer than the model's context loses its middle (8K prompts on SmolLM2):
    evidence before the cut stays where it is, evidence after it moves up, evidence in it is gone."""
    from kvlite.eval.evaluate import tokenize
    from kvlite.eval.tasks import Sample

    words = [f"w{i}" for i in range(300)]
    text = " ".join(words)
    spans = [(text.index(w), text.index(w) + len(w)) for w in ("w10", "w150", "w290")]
    sample = Sample("t", 0, text, ["x"], "contains_all", 8, chat=False, evidence=spans)
    whole = tokenize(tiny_model, sample, max_length=10_000)
    cut = tokenize(tiny_model, sample, max_length=200)
    assert len(cut.tokens) == 200 and len(whole.tokens) > 300
    near = lambda ps, lo, hi: [p for p in ps if lo <= p < hi]  # noqa: E731
    head = near(whole.evidence, 0, 100)
    tail = near(whole.evidence, len(whole.tokens) - 100, len(whole.tokens))
    assert head and tail and len(head) + len(tail) < len(whole.evidence)  # w150's tokens sit in the cut
    assert cut.evidence == head + [p - (len(whole.tokens) - 200) for p in tail]
    for p_whole, p_cut in zip(tail, cut.evidence[len(head) :]):
        assert whole.tokens[p_whole] == cut.tokens[p_cut]  # the same tokens, moved
