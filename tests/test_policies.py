"""Every policy through the shared selection on the tiny model: the kept count, protected tokens,
no workspace left behind, llama.cpp's own state agreeing."""

from __future__ import annotations

import numpy as np
import pytest

from kvlite.errors import KvliteError
from kvlite.policies import POLICIES, make_policy
from kvlite.session import Session, plan_context

SCORED = [name for name in POLICIES if name not in ("full", "streaming")]


def _run(model, name, n_prompt=300, budget=64, **params):
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, model.n_vocab, size=n_prompt)]
    policy = make_policy(name, budget=budget, sinks=4, **params)
    n_ctx, chunk = plan_context(policy, 0, len(tokens), 8, 128)
    session = Session(model, policy, n_ctx=n_ctx, chunk=chunk)
    assert session.feed(tokens)
    return session, policy


@pytest.mark.parametrize("name", SCORED)
def test_policy_keeps_budget_and_protected_tokens(tiny_model, name):
    session, policy = _run(tiny_model, name, lookahead=4, workspace=128)
    kept = session.cache.positions()
    assert len(kept) == policy.budget
    assert set(range(4)) <= set(kept.tolist()) and kept[-1] == 299
    if policy.window:
        assert set(range(300 - policy.window, 300)) <= set(kept.tolist())
    assert not session.cache.workspace_active
    assert np.array_equal(session.cache.llama_positions(0), kept)
    assert len(session.cache.llama_positions(1)) == 0
    out, _ = session.generate(4)  # the cache still decodes after the eviction
    assert np.array_equal(session.cache.llama_positions(0), session.cache.positions())


def test_echokv_and_laq_spend_the_same_workspace_passes(tiny_model):
    echo, _ = _run(tiny_model, "echokv", lookahead=6, workspace=128)
    laq, _ = _run(tiny_model, "laq", lookahead=6, workspace=128)
    assert echo.workspace_forward_passes == laq.workspace_forward_passes == 6


def test_policies_score_differently(tiny_model):
    kept = {name: tuple(_run(tiny_model, name, lookahead=4, workspace=128)[0].cache.positions()) for name in SCORED}
    assert len(set(kept.values())) >= len(SCORED) - 2  # not one selection in disguise


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("echokv", dict(lookahead=5), "even"),
        ("echokv", dict(lookahead=0), "-T must be positive"),
        ("laq", dict(workspace=32), "smaller than --budget"),
        ("snapkv", dict(pool_kernel=4), "odd"),
        ("tova", dict(aggregation="median"), "--aggregate"),
        ("cc", dict(score="prob"), "--surprise"),
    ],
)
def test_bad_parameters(name, params, message):
    with pytest.raises(KvliteError, match=message):
        make_policy(name, budget=64, **params)


def test_budget_larger_than_prompt_evicts_nothing(tiny_model):
    session, _ = _run(tiny_model, "echokv", n_prompt=40, budget=64, lookahead=4, workspace=128)
    assert session.cache.evicted == 0 and len(session.cache.positions()) == 40
