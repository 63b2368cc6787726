"""Picking defaults: only tune-split records are accepted, candidates are ranked on the cells all
of them ran, and successive halving keeps the better share each round."""

import pytest

from kvlite.errors import KvliteError
from kvlite.eval import tune


def rec(policy, sample, score, budget=128, split="tune", kl=0.1, task="single/4096"):
    return {"model": "m", "task": task, "sample": sample, "policy": policy, "budget": budget, "score": score,
            "kl": kl, "split": split}  # fmt: skip


def test_test_split_records_are_refused():
    records = [rec("a", 0, 1.0), rec("b", 0, 0.0), rec("a", 1, 1.0, split="test", task="test:single/4096")]
    with pytest.raises(KvliteError, match="test split: defaults are chosen on the tune split alone"):
        tune.tune_only(records)
    with pytest.raises(KvliteError, match="tune split alone"):
        tune.rank(records, ["a", "b"], [128])
    with pytest.raises(KvliteError, match="tune split alone"):
        tune.versus(records, "a", "b", [128])
    with pytest.raises(KvliteError, match="tune split alone"):
        tune.successive_halving(lambda specs, n: records, ["a", "b"], [1], [128], log=lambda m: None)
    old = {k: v for k, v in rec("a", 0, 1.0).items() if k != "split"}  # records from before splits: tune
    assert tune.tune_only([old]) == [old]


def test_rank_uses_common_cells_and_breaks_ties_by_kl():
    records = [rec("a", 0, 1.0, kl=0.5), rec("a", 1, 0.0, kl=0.5), rec("b", 0, 1.0, kl=0.2), rec("b", 1, 0.0, kl=0.2)]
    records += [rec("c", 0, 0.0), rec("c", 1, 0.0), rec("a", 2, 1.0)]  # a's sample 2: not run by b and c
    standings = tune.rank(records, ["a", "b", "c"], [128])
    assert [s.spec for s in standings] == ["b", "a", "c"]  # a = b = 0.5 on the common cells; b has lower KL
    assert standings[0].n == 2


def test_successive_halving_keeps_the_best_third_and_grows_n():
    quality = {f"p{i}": i / 10 for i in range(9)}  # p8 is best
    calls = []

    def run_round(specs, n):
        calls.append((sorted(specs), n))
        return [rec(s, i, float(i < quality[s] * n * 1.2)) for s in quality for i in range(n)]

    pick, rounds = tune.successive_halving(run_round, list(quality), [5, 10], [128], log=lambda m: None)
    assert pick == "p8"
    assert calls[0] == (sorted(quality), 5) and calls[1][1] == 10
    assert len(calls[1][0]) == 3 and "p8" in calls[1][0]  # the better third went on


def test_joint_grid_spells_every_combination():
    specs = tune.joint_grid("echokv", {"S": [1, 16], "T": [16, 24]})
    assert specs == ["echokv(S=1,T=16)", "echokv(S=1,T=24)", "echokv(S=16,T=16)", "echokv(S=16,T=24)"]


def test_chat_mode_difference_is_per_conversation_and_tune_only():
    """report.mode_difference: lazy - eager averaged over policies and budgets within each
    conversation, so the bootstrap's unit is the conversation (n = 2 here, not 8 cells);
    scripts/pick_chat_default.py reads it on the tune split alone."""
    import sys
    from pathlib import Path

    from kvlite.eval import report

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from pick_chat_default import mode_difference

    def chat(policy, mode, sample, score, budget, **kw):
        return {**rec(f"{policy}(evict={mode})", sample, score, budget, task="chat/1024", **kw), "evict": mode}

    records = [{**rec("full", 0, 1.0, None, task="chat/1024"), "evict": "eager"}]  # no budget: not a pair
    for policy in ("snapkv", "laq"):
        for budget in (128, 256):
            records += [chat(policy, "lazy", 0, 1.0, budget), chat(policy, "eager", 0, 0.0, budget),
                        chat(policy, "lazy", 1, 0.5, budget), chat(policy, "eager", 1, 0.5, budget)]  # fmt: skip
    iv = mode_difference(records)
    assert iv.n == 2 and iv.mean == pytest.approx(0.5)  # conversation 0: +1, conversation 1: 0
    test = [{**r, "split": "test", "task": "test:chat/1024"} for r in records]
    assert report.mode_difference(test) == iv  # the same statistic, reported on the test split
    with pytest.raises(KvliteError, match="tune split alone"):
        mode_difference([*records, *test])
    with pytest.raises(KvliteError, match="no cell ran in both chat modes"):
        report.mode_difference([r for r in records if r["evict"] == "eager"])
