"""KVzip's reconstruction score against its torch twin, and the chat modes it serves.

Tolerance (parity): f32 weights and an f32 cache on the tiny model; the captured queries and
keys carry summation-order noise (~1e-6, tests/test_reference_parity.py) and each score is one
softmax probability (<= 1), so 1e-4 is far above the noise and far below the spread of scores."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import on_backend

from kvlite.api import Session
from kvlite.engine import Model
from kvlite.errors import KvliteError
from kvlite.evict import asks_something
from kvlite.policies import KVzip, make_policy
from kvlite.policies.kvzip import POSTFIX, max_pool, repeat_prompt, to_tokens
from kvlite.reference.model import ReferenceModel
from kvlite.reference.scores import attn_pool
from kvlite.runner import Runner, RunSettings

ATOL_KVZIP = 1e-4


def twin_pair_scores(path: str, tokens: list[int], sinks: int, chunk: int, model: Model, kernel: int) -> np.ndarray:
    """KVzip's pair scores from the torch reference model: read the context, then for each chunk
    teacher-force the repeat prompt and the chunk on a copy of the cache, and score; then torch's
    max_pool1d over the scored cells (SnapKV's smoothing). The layers scored: those whose cache holds
    every cell (gemma3's global ones)."""
    ref = ReferenceModel(path)
    info = ref.info
    layers = info.full_layers
    cache = ref.new_cache()
    ref.forward(tokens, range(len(tokens)), cache)
    n = len(tokens)
    keys = torch.stack([cache.k[il] for il in layers]).permute(0, 2, 1, 3)  # [L, Hkv, n, D]
    out = np.full((len(layers), info.n_head_kv, n), np.inf)
    for c0 in range(sinks, n, chunk):
        c1 = min(c0 + chunk, n)
        previous = None if c0 == sinks else tokens[max(sinks, c0 - POSTFIX) : c0]
        seq = repeat_prompt(model, previous) + tokens[c0:c1]
        cap: dict = {}
        ref.forward(seq, range(n, n + len(seq)), copy.deepcopy(cache), capture=cap)
        q = torch.stack([cap[("q", il)] for il in layers]).permute(0, 2, 1, 3)  # [L, H, T, D]
        k = torch.stack([cap[("k", il)] for il in layers]).permute(0, 2, 1, 3)  # [L, Hkv, T, D]
        ks = torch.cat([keys[:, :, :sinks], keys[:, :, c0:c1], k], dim=2)
        s = attn_pool(q, ks, info.kq_scale, reduce="max", causal_tail=len(seq))
        out[:, :, c0:c1] = s[:, :, sinks : sinks + c1 - c0].numpy()
    if kernel > 1:
        scored = torch.from_numpy(out[:, :, sinks:])
        out[:, :, sinks:] = torch.nn.functional.max_pool1d(scored, kernel, stride=1, padding=kernel // 2).numpy()
    return out


# several passes (later prompts quote the previous chunk); one pass (the backend run: the device path is the same)
@pytest.mark.parametrize("chunk", on_backend([40, 200], {200}))
def test_kvzip_matches_its_torch_twin(tiny_path, chunk):
    path = tiny_path
    model = Model(path)
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, model.n_vocab, size=130)]
    policy = KVzip(budget=48, repeat_chunk=chunk)
    runner = Runner(model, policy, RunSettings(n_ctx=512, chunk=64, type_k="f32", type_v="f32"))
    try:
        runner.feed(tokens, evict=False)
        got = policy.pair_scores(runner.observation())
        assert not runner.cache.workspace.active and len(runner.cache.llama_positions(1)) == 0
        want = twin_pair_scores(path, tokens, policy.sinks, chunk, model, policy.pool_kernel)
        finite = np.isfinite(want)
        assert np.array_equal(finite, np.isfinite(got))
        err = np.abs(got[finite] - want[finite]).max()
        print(f"kvzip chunk {chunk}: max err {err:.2e}, spread {np.ptp(want[finite]):.2f}")
        assert err < ATOL_KVZIP and np.ptp(want[finite]) > 100 * ATOL_KVZIP
    finally:
        runner.close()
    runner = Runner(model, policy, RunSettings(n_ctx=512, chunk=64, type_k="f32", type_v="f32"))
    try:  # the eviction itself: the budget kept, llama.cpp agrees, the cache still decodes
        runner.feed(tokens)
        assert len(runner.cache.positions()) == 48
        assert np.array_equal(runner.cache.positions(), runner.cache.llama_positions(0))
        twin = to_tokens(want, policy.pair_vote, 48)
        cut = np.sort(twin)[::-1][47]  # the twin's 48th best score
        kept = runner.cache.positions()
        # the pool's plateaus tie, so compare scores, not sets: every kept cell scores at least the
        # twin's 48th best, but the last token (always kept)
        below = kept[twin[kept] < cut - ATOL_KVZIP]
        assert set(below.tolist()) <= {len(tokens) - 1}
        out, _ = runner.generate(4)
        assert len(out) == 4
    finally:
        runner.close()


def test_pair_votes_follow_a_global_threshold():
    pairs = np.array([[[np.inf, 0.9, 0.1, 0.8, 0.2], [np.inf, 0.1, 0.95, 0.7, 0.3]]])  # [1 layer, 2 heads, 5]
    votes = to_tokens(pairs, "votes", budget=3)  # the sink and 2 of 4 scored tokens: half of the 8 pairs survive
    assert np.isinf(votes[0])
    assert votes[1] > 1 and votes[2] > 1 and votes[3] > 2 and votes[4] < 1  # 0.95, 0.9, 0.8 and 0.7 survive
    assert votes[3] > votes[2] > votes[1] > votes[4]  # 3 holds two surviving pairs; ties by the mean
    np.testing.assert_allclose(to_tokens(pairs, "max", 2)[1:], [0.9, 0.95, 0.8, 0.3])


def test_selective_leaves_out_the_heads_that_pay_every_token():
    copying = [np.inf, 0.9, 0.95, 0.92, 0.9]  # median 0.91: pays every token
    picky = [np.inf, 0.01, 0.6, 0.02, 0.03]  # median 0.025
    quiet = [np.inf, 0.05, 0.01, 0.3, 0.02]  # median 0.035
    pairs = np.array([[copying, picky, quiet]])  # [1 layer, 3 heads, 5]; median of medians 0.035
    got = to_tokens(pairs, "selective", 3)
    assert np.isinf(got[0])
    np.testing.assert_allclose(got[1:], [0.05, 0.6, 0.3, 0.03])  # the max over picky and quiet only


def test_max_pool_smooths_each_head_over_the_scored_cells():
    pairs = np.array([[[np.inf, np.inf, 0.1, 0.5, 0.2, 0.0, 0.0, 0.3]]])
    got = max_pool(pairs, 3)
    assert np.isinf(got[0, 0, :2]).all()  # the sinks stay inf and lend nothing to cell 2
    np.testing.assert_allclose(got[0, 0, 2:], [0.5, 0.5, 0.5, 0.2, 0.3, 0.3])
    assert max_pool(pairs, 0) is pairs


def test_asks_something():
    assert asks_something("What is the locker code of Orla Bren?")
    assert asks_something("Tell me the code.")
    assert not asks_something("Please read the document above; I will ask questions about it.")
    assert not asks_something("Was it? No. " + "x " * 400 + "end.")  # a '?' deep inside a document


def test_lazy_mode_keeps_whole_turns_under_the_cap_then_evicts(tiny_paths):
    session = Session(tiny_paths["llama"], make_policy("snapkv", budget=60), n_ctx=512, chunk=64)
    conv = session.conversation(evict="lazy")
    rng = np.random.default_rng(0)
    words = lambda n: " ".join("ab"[i % 2] * int(rng.integers(1, 4)) for i in range(n))  # noqa: E731
    conv.turn(words(60), 8, None, lambda: False, progress=False)
    cache = conv.runner.cache
    assert cache.evicted == 0 and cache.n_resident > 60  # lazy: the turn stays whole
    for _ in range(6):
        conv.turn(words(60), 8, None, lambda: False, progress=False)
        assert cache.n_resident <= conv.cap and cache.max_cells <= conv.cap
        assert np.array_equal(cache.positions(), cache.llama_positions(0))
    assert cache.evicted > 0 and "lazy" in conv.status()
    with pytest.raises(KvliteError, match="lazy needs"):
        Session(tiny_paths["llama"], make_policy("streaming", budget=60), n_ctx=512).conversation(evict="lazy")


@pytest.mark.slow
@pytest.mark.model_answer
def test_kvzip_keeps_a_stated_once_code_before_the_question(smol_model):
    """The user's case: a document in a turn of its own, the question a turn later. At budget 128
    of ~1200 cells KVzip (kvlite's default pair vote and pooling, chosen on the tune split) keeps
    the locker code, which no question has pointed at yet; the chat then goes on."""
    import pathlib

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "needle.txt").read_text()
    doc = doc.rsplit("What is the locker code", 1)[0].strip()
    session = Session(smol_model, make_policy("kvzip", budget=128))
    conv = session.conversation(evict="eager")
    conv.turn(doc + "\n\nPlease read the document above; I will ask questions about it.", 8, None, lambda: False,
              progress=False)  # fmt: skip
    cache = conv.runner.cache
    assert cache.n_resident <= 128 + 8 and cache.evicted > 1000
    assert "54554" in session.model.detokenize(cache.tokens_at(cache.positions()))
    conv.turn("What is the locker code of Orla Bren?", 16, None, lambda: False, progress=False)
    assert "kvzip" in conv.status()
