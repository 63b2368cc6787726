"""Summary tables, plots and the throughput split from hand-made records."""

import pytest

from kvlite.eval import report


def rec(policy, budget, score, sample, kl=None, **kw):
    base = {"model": "m", "task": "single/1024", "sample": sample, "policy": policy, "budget": budget, "score": score}
    return {**base, "kl": kl, "top1": None, "exact_match": None, "token_agreement": None, "evidence_kept": None, **kw}


RECORDS = [
    rec("full", None, 1.0, 0, kl=0.0),
    rec("full", None, 0.0, 1, kl=0.0),
    rec("snapkv", 64, 1.0, 0, kl=0.5, kept=[0, 1, 2], prompt_tokens=8, evidence=[2, 3]),
    rec("snapkv", 64, 0.0, 1, kl=1.5),
    rec("snapkv", 128, 1.0, 0, kl=0.25),
    {"model": "m", "task": "single/1024", "sample": 0, "policy": "diagnostics", "budget": 128, "overlap": {}},
]


def test_summary_means_per_cell():
    rows = report.summarize(RECORDS)
    assert [(r["policy"], r["budget"], r["score"], r["n"], r["kl"]) for r in rows] == [
        ("full", None, 0.5, 2, 0.0),
        ("snapkv", 64, 0.5, 2, 1.0),  # (0.5 + 1.5) / 2
        ("snapkv", 128, 1.0, 1, 0.25),
    ]
    csv_text = report.to_csv(rows)
    assert csv_text.splitlines()[0].startswith("task,policy,budget,score,score_lo,score_hi,n,model")
    # scores (1, 0): resampled means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4: the 95% interval is [0, 1]
    assert csv_text.splitlines()[1].startswith("single/1024,full,full,0.5000,0.0000,1.0000,2,m")
    md = report.to_markdown(rows)
    assert "| policy | 64 | 128 |" in md and "| snapkv | 0.50 [0.00, 1.00] | 1.00 [1.00, 1.00] |" in md
    assert "full cache: 0.50 [0.00, 1.00]" in md


def test_plots_are_written(tmp_path):
    rows = report.summarize(RECORDS)
    scores = report.plot_scores(rows, "m", tmp_path / "s.png")
    kept = report.plot_occupancy(RECORDS, "m", "single/1024", 0, 64, tmp_path / "k.png")
    assert scores.read_bytes()[:4] == kept.read_bytes()[:4] == b"\x89PNG"
    assert report.plot_occupancy(RECORDS, "m", "single/1024", 0, 999, tmp_path / "none.png") is None


def test_score_plot_is_a_task_by_length_grid(tmp_path):
    """One row per task, one column per length, one legend: three lengths fit a page (~1000 px), where
    one row of nine panels was 4290 px wide."""
    records = [rec(p, b, 0.5, 0, task=f"test:{t}/{n}") for t in ("single", "multikey", "twohop")
               for n in (2048, 4096, 8192) for p, b in (("full", None), ("snapkv", 128), ("snapkv", 256))]  # fmt: skip
    assert report._task_and_length("test:single/2048") == ("test:single", "2048")
    assert report._task_and_length("narrativeqa") == ("narrativeqa", "")
    png = report.plot_scores(report.summarize(records), "m", tmp_path / "grid.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert 700 < width <= 1100 and height > 0.6 * width  # three columns, three rows


def test_throughput_split():
    timed = [
        {
            "time": {
                "cell_s": 4.0,
                "prefill_s": 1.0,
                "decode_s": 1.0,
                "policy_s": 0.5,
                "teacher_forcing_s": 0.5,
                "prefix_s": 6.0,
            }
        },  # fmt: skip
        {"time": {"cell_s": 2.0, "prefill_s": 0.5, "decode_s": 0.5, "policy_s": 0.5, "teacher_forcing_s": 0.25}},
    ]
    t = report.throughput(timed)
    # total 4 + 2 + 6 = 12; model 6 + 1.5 + 1.5 + 0.75 = 9.75; policies 1; overhead 1.25
    assert (t["total_s"], t["model_s"], t["policy_s"]) == (12.0, 9.75, 1.0)
    assert t["overhead_s"] == pytest.approx(1.25) and t["overhead_share"] == pytest.approx(1.25 / 12)
    same = [{"model": "m", "task": "t", "sample": 0, **r} for r in timed]
    assert report.throughput(same)["replay_saved_s"] == 6.0  # the second cell would have read the prompt again


def test_end_to_end_seconds_charge_the_shared_prefix_to_prefill_end_cells():
    base = {"model": "m", "task": "recall/1024", "sample": 0, "score": 1.0}
    records = [
        {**base, "policy": "full", "budget": None,
         "time": {"cell_s": 2.0, "teacher_forcing_s": 0.5, "prefix_s": 6.0}},
        {**base, "policy": "snapkv", "budget": 64, "time": {"cell_s": 1.0, "teacher_forcing_s": 0.25}},
        {**base, "policy": "cc(mode=chunked,h=32)", "budget": 64, "time": {"cell_s": 9.0, "teacher_forcing_s": 1.0}},
    ]  # fmt: skip
    e2e = report.end_to_end(records)
    assert e2e[("m", "recall/1024", "full", None)] == 7.5  # 2 - 0.5 + the prefix it read
    assert e2e[("m", "recall/1024", "snapkv", 64)] == 6.75  # replays the same prefix: charged for it
    assert e2e[("m", "recall/1024", "cc(mode=chunked,h=32)", 64)] == 8.0  # reads its prompt itself


def test_end_to_end_seconds_are_a_median_a_stalled_cell_cannot_move():
    cells = [{"model": "m", "task": "t/1", "sample": i, "score": 1.0, "policy": "cc(mode=chunked)", "budget": 8,
              "time": {"cell_s": s, "teacher_forcing_s": 0.0}} for i, s in enumerate([10.0, 11.0, 900.0])]  # fmt: skip
    assert report.end_to_end(cells)[("m", "t/1", "cc(mode=chunked)", 8)] == 11.0


def test_cache_evolution_plot(tmp_path):
    record = {"model": "m", "task": "recall/1024", "sample": 0, "policy": "cc(mode=chunked)", "budget": 4,
              "score": 0.5, "prompt_tokens": 10, "evidence": [3], "evolution": [[0, 1, 2, 3], [0, 1, 5, 6],
                                                                                  [0, 1, 9, 11]]}  # fmt: skip
    path = report.plot_evolution(record, tmp_path / "e.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert report.plot_evolution({**record, "evolution": []}, tmp_path / "none.png") is None


def test_one_spec_codec_reads_and_writes_specs():
    """kvlite.eval.specs reads a spec's name and its parameters as written, and adds or drops one,
    for the reports and scripts/results.py alike (issue 64: three codecs were one too many)."""
    from kvlite.eval.specs import parse_spec, spec_items, spec_name, with_param, without_param

    spec = "echokv(S=16,T=24,kernel=13,B1=512,aggregate=max)"
    assert spec_name(spec) == "echokv" and spec_name("full") == "full"
    assert spec_items(spec) == {"S": "16", "T": "24", "kernel": "13", "B1": "512", "aggregate": "max"}
    assert without_param(spec, "B1") == "echokv(S=16,T=24,kernel=13,aggregate=max)"
    assert without_param("laq(T=24)", "T") == "laq" and with_param("laq", "T=24") == "laq(T=24)"
    assert with_param("laq(T=24)", "B1=512") == "laq(T=24,B1=512)"
    # what the codec writes, the parser reads
    assert parse_spec(without_param(spec, "B1"))[1] == {
        k: v for k, v in parse_spec(spec)[1].items() if k != "workspace"
    }
