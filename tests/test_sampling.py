"""Sampling through llama.cpp's chain: greedy is the argmax; a seeded temperature is repeatable."""

from __future__ import annotations

import numpy as np
import pytest

from kvlite.cache import KVCache
from kvlite.engine import Context, Sampler, SamplingParams
from kvlite.errors import KvliteError


def _sample_run(model, params: SamplingParams, n: int = 12) -> list[int]:
    ctx = Context(model, n_ctx=128)
    cache = KVCache(ctx)
    cache.append([10, 11, 12, 13])
    sampler = Sampler(params)
    out = []
    for _ in range(n):
        t = sampler.sample(ctx.ptr)
        out.append(t)
        cache.append([t])
    return out


def test_greedy_is_argmax(tiny_model):
    ctx = Context(tiny_model, n_ctx=64)
    KVCache(ctx).append([5, 6, 7])
    assert Sampler(SamplingParams(temp=0)).sample(ctx.ptr) == int(np.argmax(ctx.logits()))


def test_seeded_sampling_is_repeatable_and_seed_dependent(tiny_model):
    a = _sample_run(tiny_model, SamplingParams(temp=1.5, top_k=0, top_p=1.0, seed=7))
    b = _sample_run(tiny_model, SamplingParams(temp=1.5, top_k=0, top_p=1.0, seed=7))
    c = _sample_run(tiny_model, SamplingParams(temp=1.5, top_k=0, top_p=1.0, seed=8))
    assert a == b
    assert a != c


@pytest.mark.parametrize("bad", [dict(temp=-1), dict(top_p=0), dict(top_k=-2)])
def test_bad_sampling_params(bad):
    with pytest.raises(KvliteError):
        SamplingParams(**bad)


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_sampling_saved_logits_equals_sampling_the_context(tiny_model, temp):
    params = SamplingParams(temp=temp, seed=3)
    ctx = Context(tiny_model, n_ctx=64)
    KVCache(ctx).append([5, 6, 7])
    from_ctx = [Sampler(params).sample(ctx.ptr) for _ in range(1)]
    from_saved = [Sampler(params).sample_logits(ctx.logits()) for _ in range(1)]
    assert from_ctx == from_saved
