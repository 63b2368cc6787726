"""The streaming policy bounds the cache whatever the prompt length."""

from __future__ import annotations

import numpy as np
import pytest

from kvlite.policies import make_policy
from kvlite.runner import Runner
from kvlite.settings import RunSettings, plan_context


def _run(model, n_prompt, budget, chunk, n_predict, sinks=4):
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, min(model.n_vocab, 30000), size=n_prompt)]
    policy = make_policy("streaming", budget=budget, sinks=sinks)
    n_ctx, chunk = plan_context(policy, 0, len(tokens), n_predict, chunk)
    runner = Runner(model, policy, RunSettings(n_ctx=n_ctx, chunk=chunk))
    assert runner.feed(tokens)
    after_prefill = runner.cache.positions()
    out, _ = runner.generate(n_predict)
    return runner, tokens, after_prefill, out


def test_streaming_runs_a_prompt_four_times_the_context(tiny_model):
    # llama.cpp rounds contexts up to 256 cells: budget + chunk = 256
    runner, tokens, kept, out = _run(tiny_model, n_prompt=4 * 256, budget=200, chunk=56, n_predict=20)
    n_ctx = runner.ctx.n_ctx
    assert n_ctx == 256 and len(tokens) >= 4 * n_ctx
    assert runner.cache.max_cells <= 200 + 56
    # sinks and the most recent tokens, nothing else
    expected = list(range(4)) + list(range(len(tokens) - 196, len(tokens)))
    assert kept.tolist() == expected
    # during generation the window slides: still sinks + the newest tokens
    final = runner.cache.positions()
    assert len(final) == 200 and final[:4].tolist() == [0, 1, 2, 3]
    assert final[-1] == len(tokens) + len(out) - 1
    assert np.array_equal(runner.cache.llama_positions(0), final)


@pytest.mark.slow
def test_streaming_on_smollm2(smol_model):
    runner, tokens, kept, out = _run(smol_model, n_prompt=4 * 256, budget=192, chunk=64, n_predict=8)
    assert len(tokens) >= 4 * runner.ctx.n_ctx
    assert runner.cache.max_cells <= 192 + 64
    assert len(kept) == 192
    assert np.array_equal(runner.cache.llama_positions(0), runner.cache.positions())
