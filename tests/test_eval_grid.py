"""Evaluation grids on the tiny model: the snapshot replay equals a plain run, scores reused across
budgets equal fresh ones, a resumed grid and a shard-and-merge run equal an uninterrupted one, a
failing cell fails alone, and the diagnostics behave as their definitions say."""

import json
import shutil

import numpy as np
import pytest
from conftest import run_cli

from kvlite.engine import SamplingParams
from kvlite.errors import KvliteError
from kvlite.eval import multiturn, tasks
from kvlite.eval.evaluate import SampleRun, tokenize
from kvlite.eval.grid import Grid, GridConfig
from kvlite.eval.records import read_records
from kvlite.eval.specs import parse_spec, split_policies
from kvlite.limits import cells_for, parse_budget
from kvlite.policies import EchoKV, SnapKV, make_policy
from kvlite.runner import Runner, RunSettings

POLICIES = ["full", "streaming", "snapkv", "echokv(T=4,B1=96)"]


def grid_cfg(tiny_paths, out, **kw) -> GridConfig:
    base = dict(models=[tiny_paths["llama"]], tasks=["single"], lengths=[300], n=3, policies=POLICIES,
                budgets=[40, 64], n_predict=6, out=str(out))  # fmt: skip
    base.update(kw)
    return GridConfig(**base)


def rows_without_time(out) -> list:
    return sorted((r["model"], r["task"], r["sample"], r["policy"], str(r["budget"]), r["score"], r["generated"],
                   r["kept"], round(r.get("kl", 0), 9)) for r in read_records(out) if "score" in r)  # fmt: skip


def stop_after(n: int):
    """A progress callback that stops the grid (as Ctrl-C would) at its n-th call."""
    calls = []

    def progress(k: int) -> None:
        calls.append(k)
        if len(calls) == n:
            raise KeyboardInterrupt

    return progress


@pytest.fixture(scope="module")
def uninterrupted(tiny_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("grid-a")
    Grid(grid_cfg(tiny_paths, out)).run()
    return out


@pytest.fixture(scope="module")
def prompt(tiny_model):
    (sample,) = tasks.generate("single", 1, 300, lambda t: len(t.encode()), seed=5)
    return tokenize(tiny_model, sample, max_new_tokens=6)


def test_grid_records_every_cell(uninterrupted):
    records = read_records(uninterrupted)
    assert len(records) == 3 * (1 + 3 * 2)
    summary = (uninterrupted / "summary.csv").read_text() if (uninterrupted / "summary.csv").exists() else None
    assert summary is None  # the Grid API writes records; the CLI writes the summary
    full = [r for r in records if r["policy"] == "full"]
    assert all(r["kl"] == pytest.approx(0, abs=1e-9) and r["top1"] == 1 and r["exact_match"] == 1 for r in full)
    evicting = [r for r in records if r["policy"] != "full"]
    assert all(len(r["kept"]) == r["budget"] for r in evicting)
    assert any(r["kl"] > 1e-3 for r in evicting)  # eviction changes the distributions (random tiny weights)


def test_snapshot_replay_equals_a_plain_run(tiny_model, prompt):
    run = SampleRun(tiny_model, prompt, tail=32)
    run.cell(EchoKV(budget=48, lookahead=4, workspace=96))  # not FullKV: no reference needed here
    for policy in (SnapKV(budget=40), EchoKV(budget=48, lookahead=4, workspace=96)):
        record = run.cell(policy)
        plain = Runner(tiny_model, policy, RunSettings(n_ctx=run.n_ctx, sampling=SamplingParams()))
        try:
            plain.feed(prompt.tokens)
            out, _ = plain.generate(prompt.max_new_tokens)
            assert record["kept"] == plain.cache_report(len(prompt.tokens))["kept_positions"]
            assert record["generated"] == out
        finally:
            plain.close()


def test_scores_reused_across_budgets_equal_fresh_ones(tiny_model, prompt):
    shared = SampleRun(tiny_model, prompt, tail=32)
    fresh = SampleRun(tiny_model, prompt, tail=32)
    for make in (lambda b: EchoKV(budget=b, lookahead=4, workspace=96), lambda b: SnapKV(budget=b)):
        shared.cell(make(64), reuse="p")
        reused = shared.cell(make(40), reuse="p")
        again = fresh.cell(make(40))
        assert reused["scores_reused"] and not again["scores_reused"]
        assert reused["kept"] == again["kept"] and reused["generated"] == again["generated"]
        assert reused["workspace_evidence"] == again["workspace_evidence"]
        shared.scores.clear()


def test_echokv_smooths_less_under_128_cells_and_no_score_crosses_that_line(tiny_model, prompt):
    # issue 25: the search's max-pool of 13 (picked at 128 and 256 cells) cut codes at 64
    assert [EchoKV(budget=b).pool_kernel for b in (None, 20, 64, 127, 128, 256)] == [13, 7, 7, 7, 13, 13]
    assert EchoKV(budget=64, pool_kernel=13).pool_kernel == 13 and make_policy("hybrid", budget=64).pool_kernel == 7
    shared, fresh = SampleRun(tiny_model, prompt, tail=32), SampleRun(tiny_model, prompt, tail=32)
    shared.cell(EchoKV(budget=128, lookahead=4, workspace=128), reuse="e")
    small = shared.cell(EchoKV(budget=64, lookahead=4, workspace=128), reuse="e")
    again = fresh.cell(EchoKV(budget=64, lookahead=4, workspace=128))
    assert not small["scores_reused"] and small["kept"] == again["kept"]


def test_votes_scores_are_not_reused(tiny_model, prompt):
    run = SampleRun(tiny_model, prompt, tail=32)
    run.cell(SnapKV(budget=64, aggregation="votes"), reuse="v")
    assert not run.scores  # votes depend on the budget
    assert not run.cell(SnapKV(budget=40, aggregation="votes"), reuse="v")["scores_reused"]


def test_resumed_grid_equals_uninterrupted(tiny_paths, tmp_path, uninterrupted):
    with pytest.raises(KeyboardInterrupt):
        Grid(grid_cfg(tiny_paths, tmp_path)).run(progress=stop_after(5))
    assert 0 < len(read_records(tmp_path)) < 21
    Grid(grid_cfg(tiny_paths, tmp_path)).run()
    assert sum(1 for _ in (tmp_path / "samples.jsonl").open()) == 21  # nothing finished was redone
    assert rows_without_time(tmp_path) == rows_without_time(uninterrupted)


def test_a_resume_left_with_chunked_cells_reads_no_prompt_for_the_reference(tiny_paths, tmp_path, monkeypatch):
    """Stopped after a sample's full-cache cell, the grid kept that cell's reference on disk: the
    resume runs the chunked cells against it without reading the prompt's prefix again, its records
    equal an uninterrupted run's, and the reference is removed once the sample is done."""
    from kvlite.eval import evaluate

    policies = ["full", "streaming(mode=chunked,h=16)", "laq(mode=chunked,h=16)"]
    cfg = lambda out: grid_cfg(tiny_paths, out, n=1, policies=policies, budgets=[48])  # noqa: E731
    Grid(cfg(tmp_path / "a")).run()
    assert not (tmp_path / "a" / "references").exists()

    with pytest.raises(KeyboardInterrupt):
        Grid(cfg(tmp_path / "b")).run(progress=stop_after(1))  # after the full cell's record
    assert [r["policy"] for r in read_records(tmp_path / "b")] == ["full"]
    assert len(list((tmp_path / "b" / "references").glob("*.npz"))) == 1
    reads = []
    real = evaluate.read_prefix
    monkeypatch.setattr(evaluate, "read_prefix", lambda *a, **k: reads.append(1) or real(*a, **k))
    Grid(cfg(tmp_path / "b")).run()
    assert reads == []  # neither the reference nor a chunked cell needed the prefix
    assert rows_without_time(tmp_path / "b") == rows_without_time(tmp_path / "a")
    assert all("kl" in r for r in read_records(tmp_path / "b"))
    assert not (tmp_path / "b" / "references").exists()


@pytest.mark.parametrize(
    ("policies", "stopped", "keep_reference"),
    [(["full", "streaming", "snapkv"], 2, False),  # the resume reruns the full cell, unwritten
     (["full", "laq(mode=chunked,h=16)", "snapkv"], 1, True)],  # the loaded reference reads no prefix first
)  # fmt: skip
def test_a_resume_charges_its_prompt_read_to_a_record(tiny_paths, tmp_path, policies, stopped, keep_reference):
    """A resume that reads the prompt again (for the full cache's rerun, or for a prefill-end cell
    after a loaded reference) writes prefix_s on its first record after the read, once: the
    end-to-end times and where the time went count it."""
    cfg = grid_cfg(tiny_paths, tmp_path, n=1, policies=policies, budgets=[48])
    with pytest.raises(KeyboardInterrupt):
        Grid(cfg).run(progress=stop_after(stopped))
    if not keep_reference:
        shutil.rmtree(tmp_path / "references")
    before = len(read_records(tmp_path))
    Grid(cfg).run()
    resumed = read_records(tmp_path)[before:]
    assert [r["policy"] for r in resumed] == policies[stopped:]
    charged = [r["policy"] for r in resumed if "prefix_s" in r["time"]]
    assert charged == ["snapkv"] and resumed[-1]["time"]["prefix_s"] > 0


def test_a_grid_stopped_early_has_every_task(tiny_paths, tmp_path):
    """Samples run by index across tasks (single 0, multikey 0, single 1, ...), so a long stage
    carried over sessions reports every task, not the first one's samples alone."""
    cfg = grid_cfg(tiny_paths, tmp_path, tasks=["single", "multikey"], policies=["full"])
    with pytest.raises(KeyboardInterrupt):
        Grid(cfg).run(progress=stop_after(3))
    done = [(r["task"].partition("/")[0], r["sample"]) for r in read_records(tmp_path)]
    assert done == [("single", 0), ("multikey", 0), ("single", 1)]


def test_partial_last_line_is_repaired_and_its_cell_redone(tiny_paths, tmp_path, uninterrupted):
    """A kill mid-write leaves half a record: the next run drops it, redoes that cell, and the
    records equal an uninterrupted run's."""
    Grid(grid_cfg(tiny_paths, tmp_path)).run()
    path = tmp_path / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # the last record cut in half
    logged = []
    Grid(grid_cfg(tiny_paths, tmp_path), log=logged.append).run()
    assert any("dropped a partial last line" in m for m in logged)
    assert all(json.loads(line) for line in path.read_text().splitlines())
    assert sum(1 for _ in path.open()) == 21
    assert rows_without_time(tmp_path) == rows_without_time(uninterrupted)


def test_summary_of_full_only_is_a_table(tiny_paths, tmp_path):
    from kvlite.eval import report

    Grid(grid_cfg(tiny_paths, tmp_path, policies=["full"])).run()
    md = report.to_markdown(report.summarize(read_records(tmp_path)))
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table[0] == "| policy | score |" and table[1] == "|---|---|" and table[2].startswith("| full | ")
    assert all(line.count("|") == 3 for line in table)


def test_shards_merged_equal_one_run(tiny_paths, tmp_path, uninterrupted):
    for i in (1, 2):
        Grid(grid_cfg(tiny_paths, tmp_path / f"s{i}", shard=f"{i}/2")).run()
    assert {r["sample"] for r in read_records(tmp_path / "s1")} == {0, 2}
    r = run_cli("eval", "--merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m"),
                "--no-plots")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert rows_without_time(tmp_path / "m") == rows_without_time(uninterrupted)
    header = (tmp_path / "m" / "summary.csv").read_text().splitlines()[0]
    assert header.startswith("task,policy,budget,score,score_lo,score_hi,n")


def test_a_failing_cell_fails_alone(tiny_paths, tmp_path):
    r = run_cli("eval", "-m", tiny_paths["llama"], "--tasks", "single", "--lengths", "300", "-n", "1",
                "--policies", "full,snapkv", "--budgets", "3,48", "--n-predict", "4", "--out", str(tmp_path),
                "--no-plots")  # fmt: skip
    assert r.returncode == 1
    assert "policy=snapkv budget=3" in r.stderr and "Traceback" not in r.stderr
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").open()]
    assert [(e["policy"], e["budget"]) for e in errors] == [("snapkv", 3)]
    done = {(x["policy"], x["budget"]) for x in read_records(tmp_path)}
    assert done == {("full", None), ("snapkv", 48)}
    assert (tmp_path / "summary.md").exists()


def test_overlap_diagnostic(tiny_model, prompt):
    run = SampleRun(tiny_model, prompt, tail=32)
    whole = run.overlap(budget=32, lookahead=8, workspace=4096)  # W1 is the whole prompt: the true path
    assert whole["frozen"] == pytest.approx([1.0] * 8)
    part = run.overlap(budget=32, lookahead=8, workspace=64)
    assert part["frozen"][:4] == part["refreshed"][:4]  # the schedules differ only after T/2
    assert all(0 <= v <= 1 for v in part["frozen"] + part["refreshed"])
    assert min(part["frozen"]) < 1.0


def test_specs_and_config(tmp_path):
    assert parse_spec("echokv(T=8,aggregate=mean)") == ("echokv", {"lookahead": 8, "aggregation": "mean"})
    assert split_policies("full,echokv(T=8,B1=256),cc") == ["full", "echokv(T=8,B1=256)", "cc"]
    for bad in ("echo", "echokv(T)", "snapkv(lookahead=3)"):
        with pytest.raises(KvliteError):
            parse_spec(bad)
    cfg_file = tmp_path / "grid.toml"
    cfg_file.write_text('policies = ["full", "tova"]\nbudgets = [64]\nn = 2\n')
    cfg = GridConfig.load(cfg_file, {"budgets": [32, 48], "n": None})
    assert (cfg.policies, cfg.budgets, cfg.n) == (["full", "tova"], [32, 48], 2)
    cfg_file.write_text("polices = ['full']\n")
    with pytest.raises(KvliteError, match="unknown config key"):
        GridConfig.load(cfg_file, {})
    with pytest.raises(KvliteError, match="shard"):
        GridConfig.load(None, {"shard": "3/2"})
    assert np.isfinite(len(cfg.tasks))


def test_config_file_with_cli_overrides_and_json(tiny_paths, tmp_path):
    cfg = tmp_path / "grid.toml"
    cfg.write_text(
        f'models = ["{tiny_paths["llama"]}"]\ntasks = ["vt"]\nlengths = [300]\nn = 1\n'
        'policies = ["full", "tova", "echokv(T=2,B1=64)"]\nbudgets = [24, 48]\nn-predict = 4\n'
    )
    r = run_cli("eval", "--config", str(cfg), "--budgets", "48", "--out", str(tmp_path / "o"), "--json", "--no-plots")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {(x["task"], x["policy"], x["budget"], x["n"]) for x in rows} == {
        ("vt/300", "full", None, 1), ("vt/300", "tova", 48, 1), ("vt/300", "echokv(T=2,B1=64)", 48, 1)
    }  # fmt: skip
    assert "harness overhead" not in r.stdout  # stdout is the JSON alone
    # stderr is not a terminal: a line per finished cell, the log of a run in the background
    logged = [line for line in r.stderr.splitlines() if line.startswith("[eval] ")]
    assert [line.split(" cells")[0] for line in logged] == ["[eval] 1/3", "[eval] 2/3", "[eval] 3/3"], r.stderr
    assert logged[-1].endswith("~0:00:00 left")


def test_budgets_as_a_share_of_each_prompt(tiny_paths, tmp_path):
    """--budgets 50%: each prompt keeps half its tokens, rounded down as kvpress's presses round; the
    record says the cells it resolved to. A TOML file takes them too; nonsense shares are refused."""
    assert [parse_budget(b) for b in ("12.5%", " 2% ", "100%", "64", 64)] == ["12.5%", "2%", "100%", 64, 64]
    assert [cells_for(b, n) for b, n in (("12.5%", 1000), ("1%", 50), (64, 1000), (None, 9))] == [125, 1, 64, None]
    for bad in ("0%", "101%", "nan%", "x%", "-5", "1e3"):
        with pytest.raises(KvliteError, match="--budgets"):
            parse_budget(bad, "--budgets")
    cfg = tmp_path / "grid.toml"
    cfg.write_text(f'models = ["{tiny_paths["llama"]}"]\ntasks = ["single"]\nlengths = [300]\nn = 1\n'
                   'policies = ["full", "snapkv"]\nbudgets = ["50%", 48]\nn-predict = 4\n')  # fmt: skip
    r = run_cli("eval", "--config", str(cfg), "--out", str(tmp_path / "o"), "--json")
    assert r.returncode == 0, r.stderr
    assert [(x["policy"], x["budget"]) for x in json.loads(r.stdout)] == [("full", None), ("snapkv", 48),
                                                                           ("snapkv", "50%")]  # fmt: skip
    (half,) = [x for x in read_records(tmp_path / "o") if x["budget"] == "50%"]
    assert half["budget_cells"] == half["prompt_tokens"] // 2 == len(half["kept"])
    assert (tmp_path / "o" / "plots" / "scores-tiny-llama.png").exists()
    with pytest.raises(KvliteError, match="a conversation's budget is in cells"):
        GridConfig.load(None, {"tasks": ["chat"], "budgets": ["10%"]})


def test_restored_cache_agrees_with_llama_state(tiny_model, prompt):
    run = SampleRun(tiny_model, prompt, tail=32)
    runner = run.runner(SnapKV(budget=40))
    try:
        for _ in range(2):  # a second restore replaces the first one's evicted cache entirely
            runner.restore(run.prefix())
            assert runner.cache.n_pos == len(prompt.tokens) - 32
            assert np.array_equal(runner.cache.positions(), runner.cache.llama_positions(0))
            runner.feed(prompt.tokens[-32:])
            assert runner.cache.n_resident == 40
            assert np.array_equal(runner.cache.positions(), runner.cache.llama_positions(0))
    finally:
        runner.close()


def test_question_window_protects_the_closing_question(tiny_paths, tmp_path):
    """window=question keeps every token from the closing question's start, whatever the scores say;
    the split is recorded with each cell."""
    out = tmp_path / "q"
    Grid(grid_cfg(tiny_paths, out, n=1, policies=["full", "tova", "tova(window=question)"], budgets=[180])).run()
    records = {r["policy"]: r for r in read_records(out)}
    n = records["full"]["prompt_tokens"]
    sample = tasks.generate("single", 1, 300, lambda t: len(t.encode()))[0]
    q_chars = len(sample.prompt) - sample.question[0]
    protected = set(range(n - q_chars, n))  # byte-level vocabulary: one token per byte of the question
    assert protected <= set(records["tova(window=question)"]["kept"])
    assert not protected <= set(records["tova"]["kept"])  # TOVA alone drops some of it
    assert {r["split"] for r in records.values()} == {"tune"}


def test_chunked_cells_take_h_and_record_the_cache_evolution(tiny_paths, tmp_path):
    out = tmp_path / "evo"
    cfg = grid_cfg(tiny_paths, out, n=1, policies=["full", "cc-fast(mode=chunked,h=16)"], budgets=[48],
                   evolution=True)  # fmt: skip
    Grid(cfg).run()
    (r,) = [r for r in read_records(out) if r["policy"] != "full"]
    n = r["prompt_tokens"]
    # a refresh after every 16-token chunk of the prompt past the cache, and every 16 generated tokens
    assert len(r["evolution"]) >= (n - 48) // 16
    assert all(len(kept) == 48 for kept in r["evolution"])
    assert r["evolution"][-1][-1] >= n - 1  # the last refreshes hold the newest tokens


def test_test_split_is_labelled_and_unknown_split_refused(tiny_paths, tmp_path):
    out = tmp_path / "t"
    Grid(grid_cfg(tiny_paths, out, n=1, policies=["full"], split="test")).run()
    (r,) = read_records(out)
    assert r["split"] == "test" and r["task"] == "test:single/300"
    with pytest.raises(KvliteError, match="--split"):
        grid_cfg(tiny_paths, out, split="holdout").validate()
    with pytest.raises(KvliteError, match="no parameter"):
        parse_spec("snapkv(h2=3)")


def test_teacher_forcing_runs_in_pieces_of_a_small_chunk(tiny_paths, tmp_path):
    """A chunked cell with h shorter than the continuation still gets its fidelity (the continuation
    is fed in pieces of h: a batch cannot return more logits than it holds)."""
    out = tmp_path / "h4"
    Grid(grid_cfg(tiny_paths, out, n=1, policies=["full", "streaming(mode=chunked,h=4)"], budgets=[48])).run()
    records = {r["policy"]: r for r in read_records(out)}
    assert len(records["full"]["generated"]) > 4
    assert "kl" in records["streaming(mode=chunked,h=4)"]


def test_multi_turn_tasks_run_per_turn_in_both_modes(tiny_paths, tmp_path):
    policies = ["full", "snapkv", "snapkv(evict=lazy)", "kvzip(C=64)", "hybrid(T=4,B1=96,C=64,evict=lazy)"]
    cfg = grid_cfg(tiny_paths, tmp_path, tasks=["chat", "chat-hop"], n=1, policies=policies, budgets=[48],
                   n_predict=None)  # fmt: skip
    grid = Grid(cfg)
    grid.run()
    assert grid.failures == 0
    records = read_records(tmp_path)
    assert len(records) == 2 * (1 + 4)
    for r in records:
        n_questions = 4 if r["task"].startswith("chat/") else 2
        assert len(r["turn_scores"]) == n_questions and len(r["outputs"]) == n_questions + 1 + (r["task"] != "chat/300")
        assert r["max_cells"] <= r["cap"], (r["task"], r["policy"], r["turns"], r["cap"], r["max_cells"])
        assert r["evict"] == ("lazy" if "evict=lazy" in r["policy"] else "eager")
    eager = next(r for r in records if r["policy"] == "snapkv" and r["task"] == "chat/300")
    lazy = next(r for r in records if r["policy"] == "snapkv(evict=lazy)" and r["task"] == "chat/300")
    assert eager["turns"][0].startswith("evicted")  # the document turn is cut to the budget at once
    # Lazy: the document stays whole, and the first question (turn 2) forces the eviction with its queries
    assert lazy["turns"][0] == "nothing evicted" and lazy["turns"][1].startswith("evicted"), lazy["turns"]
    assert lazy["cap"] < eager["cap"]
    with pytest.raises(KvliteError, match="evict must be one of"):
        parse_spec("snapkv(evict=sometimes)")


def test_recall_is_a_grid_axis_of_multi_turn_tasks(tiny_paths, tmp_path):
    """snapkv(recall=8): each eager turn evicts to the budget, then brings back at most 8 cells;
    the record says how many cells the store held and its bytes."""
    cfg = grid_cfg(tiny_paths, tmp_path, tasks=["chat"], n=1, policies=["snapkv", "snapkv(recall=8)"], budgets=[48],
                   n_predict=None)  # fmt: skip
    grid = Grid(cfg)
    grid.run()
    assert grid.failures == 0
    (r,) = [r for r in read_records(tmp_path) if r["policy"] == "snapkv(recall=8)"]
    assert r["recall"] == 8 and r["stored_cells"] > 0 and r["store_bytes"] > 0 and r["max_cells"] <= r["cap"]
    assert r["decode_cells"] <= 48 + 8  # eager: the budget and what came back, when a reply began
    assert any("recalled" in turn for turn in r["turns"])
    for bad, words in ((dict(tasks=["single"]), "multi-turn tasks only"),
                       (dict(tasks=["chat"], policies=["knorm(recall=8)"]), "knorm captures none"),
                       (dict(tasks=["chat"], policies=["laq(recall_lookahead=1)"]), "give recall=N too"),
                       (dict(tasks=["chat"], policies=["laq(recall=8,recall_lookahead=2)"]), "lookahead")):  # fmt: skip
        with pytest.raises(KvliteError, match=words):
            grid_cfg(tiny_paths, tmp_path / "x", **{"policies": ["snapkv(recall=8)"], **bad}).validate()
    with pytest.raises(KvliteError, match="evict chooses when a conversation evicts"):  # it was a TypeError per cell
        grid_cfg(tiny_paths, tmp_path / "y", tasks=["single", "chat"], policies=["echokv(evict=lazy)"]).validate()


@pytest.mark.parametrize("spec", ["snapkv", "snapkv(evict=lazy)", "kvzip(C=64)", "echokv(T=4,B1=96,evict=lazy)", "h2o"])
def test_a_conversation_from_shared_work_equals_one_that_does_it_all(tiny_model, spec):
    """The grid reads a conversation's document once (multiturn.read_document) and shares the first
    eviction's scores between budgets (multiturn.FirstEviction); what each turn says, keeps and
    evicts must be what a cell doing all of it itself gets."""
    (sample,) = tasks.generate("chat", 1, 300, lambda t: len(t.encode()), seed=3)
    name, params = parse_spec(spec)
    evict = params.pop("evict", "eager")
    document = multiturn.read_document(tiny_model, sample, tail=32)
    assert document is not None and len(document.tokens) > 200
    memo: dict = {}
    for budget in (64, 48):  # the second budget reuses the first one's scores
        one, other = (make_policy(name, budget=budget, **params) for _ in range(2))
        plain = multiturn.run_conversation(tiny_model, sample, one, evict)
        shared = multiturn.run_conversation(tiny_model, sample, other, evict, document=document, memo=(memo, spec))
        for key in ("outputs", "turn_scores", "turns", "evicted", "max_cells", "cap", "workspace_forward_passes"):
            assert plain[key] == shared[key], (budget, key)
        assert shared["prefill_tokens"] + len(document.tokens) == plain["prefill_tokens"]  # (not seconds: noisy)
        assert shared["scores_reused"] == (budget == 48)
    assert len(memo) == 2  # the scores, and what computing them cost


def test_records_keep_their_order_when_the_new_lines_are_gzipped(tmp_path):
    """A resumed stage appends to samples.jsonl beside its samples.jsonl.gz; joined into the .gz
    (old lines, then new), the records read back in the same order, a later line's value winning."""
    import gzip

    recs = [{"model": "m", "task": "t", "sample": 0, "policy": p, "budget": 8, "score": 0} for p in "abcd"]
    lines = [json.dumps(r) + "\n" for r in recs]
    newer = json.dumps({**recs[1], "score": 1}) + "\n"  # b again, rewritten by the resumed run
    (tmp_path / "samples.jsonl.gz").write_bytes(gzip.compress("".join(lines[:2]).encode()))
    (tmp_path / "samples.jsonl").write_text("".join(lines[2:]) + newer)
    split = read_records(tmp_path)
    (tmp_path / "samples.jsonl").unlink()
    (tmp_path / "samples.jsonl.gz").write_bytes(gzip.compress("".join(lines + [newer]).encode()))
    joined = read_records(tmp_path)
    assert [r["policy"] for r in split] == [r["policy"] for r in joined] == list("abcd")
    assert split == joined and split[1]["score"] == 1


def test_gzipped_records_are_read_and_not_redone(tiny_paths, tmp_path, uninterrupted):
    """A finished stage may keep its records gzipped (results-runs/): they count as done."""
    import gzip

    Grid(grid_cfg(tiny_paths, tmp_path)).run()
    path = tmp_path / "samples.jsonl"
    (tmp_path / "samples.jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    assert len(read_records(tmp_path)) == 21
    Grid(grid_cfg(tiny_paths, tmp_path)).run()
    assert not path.exists() or path.read_text() == ""  # nothing was redone
