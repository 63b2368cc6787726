"""Every policy through the shared selection on the tiny model: the kept count, protected tokens,
no workspace left behind, llama.cpp's own state agreeing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import on_backend

from kvlite.errors import KvliteError
from kvlite.native import COUNTER_CAUSAL_ARCHS
from kvlite.policies import POLICIES, make_policy
from kvlite.runner import Runner
from kvlite.settings import RunSettings, plan_context

SCORED = [name for name in POLICIES if name not in ("full", "streaming")]
# One policy per device code path of the scores: lookahead on workspaces with pooled attention,
# counter-causal logits from kept hidden states, KVzip's reconstruction passes.
BACKEND_POLICIES = {"echokv", "cc-fast", "kvzip"}


def _policy(name, **params):
    """make_policy with the test's shared settings, leaving out those a policy does not take."""
    return make_policy(name, **{k: v for k, v in params.items() if k in POLICIES[name].params()})


def _run(model, name, n_prompt=300, budget=64, **params):
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, model.n_vocab, size=n_prompt)]
    policy = _policy(name, budget=budget, sinks=4, **params)
    n_ctx, chunk = plan_context(policy, 0, len(tokens), 8, 128)
    runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk))
    assert runner.feed(tokens)
    return runner, policy


@pytest.mark.parametrize("name", SCORED)
def test_policy_keeps_budget_and_protected_tokens(tiny_model, name):
    runner, policy = _run(tiny_model, name, lookahead=4, workspace=128)
    kept = runner.cache.positions()
    assert len(kept) == policy.budget
    assert set(range(4)) <= set(kept.tolist()) and kept[-1] == 299
    if policy.window:
        assert set(range(300 - policy.window, 300)) <= set(kept.tolist())
    assert not runner.cache.workspace.active
    assert np.array_equal(runner.cache.llama_positions(0), kept)
    assert len(runner.cache.llama_positions(1)) == 0
    out, _ = runner.generate(4)  # the cache still decodes after the eviction
    assert np.array_equal(runner.cache.llama_positions(0), runner.cache.positions())


def test_echokv_and_laq_spend_the_same_workspace_passes(tiny_model):
    echo, _ = _run(tiny_model, "echokv", lookahead=6, workspace=128)
    laq, _ = _run(tiny_model, "laq", lookahead=6, workspace=128)
    assert echo.workspace_forward_passes == laq.workspace_forward_passes == 6


def test_echokv_proposals_at_every_position_are_the_default(tiny_model):
    """P = T rotates each anchor to every future position, as the default does: the same cells kept;
    P = 1 rotates them to the first only, and keeps other cells."""
    kept = {p: _run(tiny_model, "echokv", lookahead=6, workspace=128, proposals=p)[0].cache.positions().tolist()
            for p in (None, 6, 1)}  # fmt: skip
    assert kept[6] == kept[None] and kept[1] != kept[None]


def test_echokv_default_proposals_from_a_long_cache(tiny_model, monkeypatch):
    """From LONG_CACHE resident cells (16000; here lowered to the prompt's 300) the default rotates
    each anchor to LONG_PROPOSALS of the T positions: the cells P=2 keeps, not those P = T keeps.
    An explicit P, or T below LONG_PROPOSALS, holds whatever the length."""
    monkeypatch.setattr("kvlite.policies.lookahead.LONG_PROPOSALS", 2)
    short = _run(tiny_model, "echokv", lookahead=6, workspace=128)[0].cache.positions().tolist()
    monkeypatch.setattr("kvlite.policies.lookahead.LONG_CACHE", 300)
    kept = {p: _run(tiny_model, "echokv", lookahead=6, workspace=128, proposals=p)[0].cache.positions().tolist()
            for p in (None, 2, 6)}  # fmt: skip
    assert kept[None] == kept[2] != kept[6] == short
    echo = _policy("echokv", lookahead=6)
    assert [echo.proposal_count(n) for n in (299, 300)] == [None, 2]
    assert _policy("echokv", lookahead=6, proposals=4).proposal_count(10**6) == 4
    assert _policy("echokv", lookahead=2).proposal_count(10**6) == 2
    monkeypatch.setattr("kvlite.policies.lookahead.LONG_PROPOSALS", 8)
    assert echo.proposal_count(10**6) == 6  # at most T


def test_policies_score_differently(tiny_model):
    kept = {name: tuple(_run(tiny_model, name, lookahead=4, workspace=128)[0].cache.positions()) for name in SCORED}
    assert len(set(kept.values())) >= len(SCORED) - 2  # not one selection in disguise


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("echokv", dict(lookahead=5), "even"),
        ("echokv", dict(lookahead=0), "-T must be >= 1, got 0"),
        ("echokv", dict(lookahead=4, proposals=5), "at most 4, got 5"),
        ("echokv", dict(proposals=0), "--proposals must be >= 1, got 0"),
        ("laq", dict(workspace=32), "smaller than --budget"),
        ("snapkv", dict(pool_kernel=4), "odd"),
        ("tova", dict(aggregation="median"), "--aggregate"),
        ("cc", dict(score="prob"), "--surprise"),
    ],
)
def test_bad_parameters(name, params, message):
    with pytest.raises(KvliteError, match=message):
        make_policy(name, budget=64, **params)


@pytest.mark.parametrize("name,base", [("echokv", 512), ("laq", 1024), ("hybrid", 512)])
def test_default_workspace_grows_to_a_larger_budget(name, base):
    """B1 defaults to its searched size, or to the budget above it (a 2% budget of a 32K prompt is
    655 cells), instead of refusing the budget; a B1 given below the budget is still refused."""
    workspace = lambda policy: getattr(policy, "echokv", policy).workspace  # noqa: E731
    assert workspace(make_policy(name, budget=64)) == workspace(make_policy(name)) == base
    assert workspace(make_policy(name, budget=base + 143)) == base + 143
    with pytest.raises(KvliteError, match="smaller than --budget"):
        make_policy(name, budget=base + 143, workspace=base).validate()


def test_echokv_runs_at_a_budget_above_its_default_workspace(tiny_model):
    runner, policy = _run(tiny_model, "echokv", n_prompt=700, budget=600, lookahead=4)
    assert policy.workspace == 600 and len(runner.cache.positions()) == 600
    views = runner.last_eviction.workspace_views  # W1, then W2, each with the last token
    assert len(views) == 2 and all(len(set(v.tolist()) - {699}) == 600 for v in views)


@pytest.mark.parametrize("name", on_backend(["echokv", "laq"], {"echokv"}))
def test_a_copied_workspace_scores_as_the_shared_one(tiny_path, name, monkeypatch):
    """A workspace of at most a quarter of the cache is copied to a small context of its own, and
    the lookahead there gives the scores of the lookahead on the whole cache's context (f32: the
    same values summed in another order, ~1e-7 relative measured; 1e-5 allowed) and the same kept
    cells, on every architecture's tiny model. The small context is gone after the eviction."""
    from kvlite.engine import Model

    monkeypatch.setattr("kvlite.runner.copies_workspaces", lambda ctx: True)  # on a device as well
    model = Model(tiny_path)
    rng = np.random.default_rng(2)
    tokens = [int(t) for t in rng.integers(3, model.n_vocab, size=600)]
    out = {}
    for copied in (True, False):
        policy = _policy(name, budget=64, sinks=4, lookahead=6, workspace=128)
        n_ctx, chunk = plan_context(policy, 0, len(tokens), 8, 128)
        runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk, type_k="f32", type_v="f32"))
        made = []
        if copied:
            make = runner.cache.workspace.make_context
            runner.cache.workspace.make_context = lambda n: made.append(make(n)) or made[-1]  # noqa: B023
        else:
            runner.cache.workspace.make_context = None
        runner.feed(tokens)
        ev = runner.last_eviction
        out[copied] = (ev.scores, runner.cache.positions().tolist())
        assert len(made) == (1 if copied else 0) and all(c.ptr is None for c in made)  # made, then closed
        assert not runner.cache.workspace.active and len(runner.cache.llama_positions(1)) == 0
        runner.close()
    (s_copy, kept_copy), (s_shared, kept_shared) = out[True], out[False]
    assert np.abs(s_copy - s_shared).max() <= 1e-5 * np.abs(s_shared).max()
    assert kept_copy == kept_shared


def test_budget_larger_than_prompt_evicts_nothing(tiny_model):
    runner, _ = _run(tiny_model, "echokv", n_prompt=40, budget=64, lookahead=4, workspace=128)
    assert runner.cache.evicted == 0 and len(runner.cache.positions()) == 40


@pytest.mark.parametrize("name", on_backend(SCORED, BACKEND_POLICIES))
def test_generation_after_eviction_matches_the_reference(tiny_path, name):
    """Greedy generation on the kept cells equals the torch reference's on the same cells (f32
    model, f32 cache: the same tokens), on every architecture's tiny model."""
    import torch

    from kvlite.engine import Model
    from kvlite.reference.model import ReferenceModel

    path = tiny_path
    model = Model(path)
    if name.startswith("cc") and model.info.arch not in COUNTER_CAUSAL_ARCHS:
        pytest.skip(f"{name} refuses {model.info.arch} (test_counter_causal)")
    rng = np.random.default_rng(1)
    tokens = [int(t) for t in rng.integers(3, model.n_vocab, size=200)]
    policy = _policy(name, budget=48, sinks=4, lookahead=4, workspace=96)
    n_ctx, chunk = plan_context(policy, 0, len(tokens), 8, 64)
    runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk, type_k="f32", type_v="f32"))
    runner.feed(tokens)
    kept = runner.cache.positions().tolist()
    out, _ = runner.generate(8)

    ref = ReferenceModel(path)
    cache = ref.new_cache()
    logits = ref.forward(tokens, range(len(tokens)), cache)[-1]
    cache.keep(kept)
    want = []
    for i in range(len(out)):
        t = int(torch.argmax(logits))
        want.append(t)
        logits = ref.forward([t], [len(tokens) + i], cache)[-1]
    assert out == want


@pytest.mark.parametrize("name", SCORED)
def test_chunked_mode_bounds_the_cache(tiny_model, name):
    """Refresh every chunk of prompt and of generation: a prompt 4x the context runs in budget +
    chunk (+ lookahead) cells, and llama.cpp agrees on what is resident after every refresh."""
    rng = np.random.default_rng(2)
    tokens = [int(t) for t in rng.integers(3, tiny_model.n_vocab, size=2100)]
    policy = _policy(name, budget=160, sinks=4, mode="chunked", lookahead=4, workspace=192, repeat_chunk=32)
    n_ctx, chunk = plan_context(policy, 0, len(tokens), 40, 64)
    runner = Runner(tiny_model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk))
    assert len(tokens) >= 4 * runner.ctx.n_ctx
    runner.feed(tokens)
    assert len(runner.cache.positions()) == 160
    out, _ = runner.generate(40)
    assert runner.cache.max_cells <= 160 + 64 + policy.lookahead_cells()
    assert len(runner.cache.positions()) <= 160 + 64
    assert np.array_equal(runner.cache.llama_positions(0), runner.cache.positions())


def test_chunk_larger_than_cache_is_refused():
    policy = make_policy("snapkv", budget=64, mode="chunked")
    with pytest.raises(KvliteError, match="larger than the cache"):
        plan_context(policy, 0, 1000, 8, 128)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("name", SCORED)
def test_policies_on_every_tiny_architecture(tiny_paths, arch, name):
    from kvlite.engine import Model

    if name.startswith("cc") and arch == "gemma3":
        pytest.skip("counter-causal refuses gemma3 (test_counter_causal)")
    runner, policy = _run(Model(tiny_paths[arch]), name, lookahead=4, workspace=128)
    kept = runner.cache.positions()
    assert len(kept) == policy.budget and set(range(4)) <= set(kept.tolist())
    assert np.array_equal(runner.cache.llama_positions(0), kept)


@pytest.mark.slow
def test_every_policy_on_smollm2(smol_model):
    """The real model: each policy keeps its budget and protected tokens, leaves no workspace,
    and llama.cpp agrees on what is resident."""
    from kvlite.eval.haystack import haystack

    tokens = smol_model.tokenize("\n\n".join(haystack(8)))[:600]
    for name in SCORED:
        policy = make_policy(name, budget=128, sinks=4)
        n_ctx, chunk = plan_context(policy, 0, len(tokens), 4, 512)
        runner = Runner(smol_model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk))
        runner.feed(tokens)
        kept = runner.cache.positions()
        assert len(kept) == 128 and set(range(4)) <= set(kept.tolist()) and kept[-1] == len(tokens) - 1, name
        assert not runner.cache.workspace.active and len(runner.cache.llama_positions(1)) == 0, name
        assert np.array_equal(runner.cache.llama_positions(0), kept), name
        if name == "kvzip":  # reconstruction passes, a batch each
            assert runner.workspace_forward_passes > 0
        else:  # the hybrid looks ahead when the turn's kind is unknown
            lookahead = name in ("echokv", "laq", "hybrid")
            assert runner.workspace_forward_passes == (runner.policy.lookahead if lookahead else 0), name
        runner.close()
