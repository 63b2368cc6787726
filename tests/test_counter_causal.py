"""Counter-causal surprise: the torch twin against the definition, the native pass against the twin.

Tolerances: on the tiny f32 models with an f32 cache the native pass is f32 arithmetic on the
same inputs as a float64 twin; logits are O(1-100) (qwen2's tied embeddings are large), so
1e-3 absolute is ~100x the summation-order noise of test_reference_parity. Keep-sets are compared
exactly. On SmolLM2 Q4_1, llama.cpp rounds activations to Q8 before every quantized matmul and
the twin does not (~8e-2 on post-RoPE Q: docs/design.md, "Measured facts the code relies on"), so
only the keep-sets are compared, against a floor measured with margin."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_SPECS

from kvlite.cache import KVCache
from kvlite.engine import Capture, Context, Model
from kvlite.errors import KvliteError
from kvlite.native import COUNTER_CAUSAL_ARCHS
from kvlite.reference.counter_causal import counter_causal_logits
from kvlite.reference.model import RefCache, ReferenceModel
from kvlite.scoring.surprise import CacheContents, SurpriseModel, cache_contents, surprise
from kvlite.selection import protected_positions, select_keep

ATOL = 1e-3


@pytest.fixture(scope="module", params=sorted(a for a, spec in TINY_SPECS.items() if spec.arch in COUNTER_CAUSAL_ARCHS))
def tiny_path(request, tiny_paths):
    """The tiny models of the architectures the native pass runs (gemma3's refusal is tested below)."""
    return tiny_paths[request.param]


def _tokens(n, n_vocab, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, min(n_vocab, 30000), size=n)]


def _later_cells(ref, rc, i, n):
    """A cache of only the cells after i, and a mask that shows them, not the new token itself."""
    later = RefCache(ref.info.n_layer)
    later.pos = torch.arange(i + 1, n)
    later.k = [kl[i + 1 :] for kl in rc.k]
    later.v = [vl[i + 1 :] for vl in rc.v]
    return later, torch.tensor([[True] * (n - 1 - i) + [False]])


def test_twin_matches_the_definition(tiny_path):
    """Cell by cell: token x_i alone at p_i over a cache holding only the later cells, itself
    masked out, through every layer - a plain forward with an explicit mask."""
    ref = ReferenceModel(tiny_path)
    n = 12
    toks = _tokens(n, ref.info.n_vocab, 0)
    rc = ref.new_cache()
    ref.forward(toks, range(n), rc)
    k = torch.stack(rc.k)
    v = torch.stack(rc.v)
    twin = counter_causal_logits(ref, torch.tensor(toks), torch.arange(n), k, v)
    for i in range(n - 1):
        later, visible = _later_cells(ref, rc, i, n)
        logits = ref.forward([toks[i]], [i], later, visible=visible)
        assert abs(float(logits[0, toks[i]]) - float(twin[i])) < 1e-9
    assert torch.isnan(twin[-1])


def _engine_cache(path, toks, keep=None):
    model = Model(path)
    info = model.info
    cap = Capture(info)
    cap.request("hidden", [info.n_layer - 2])
    ctx = Context(model, n_ctx=len(toks) + 64, n_batch=64, type_k="f32", type_v="f32", capture=cap)
    cache = KVCache(ctx, hidden_layer=info.n_layer - 2)
    cache.append(toks)
    if keep is not None:
        cache.evict(keep)
    return model, cache


def _twin_from(ref, contents: CacheContents, variant, score, min_gap=0, blind=False):
    info = ref.info
    first = 0 if variant == "full" else info.n_layer - 1
    shape = (info.n_layer - first, len(contents.tokens), info.n_head_kv, info.head_dim)
    k = torch.from_numpy(np.asarray(contents.k).astype(np.float64)).reshape(shape).to(ref.dtype)
    v = torch.from_numpy(np.asarray(contents.v).astype(np.float64)).reshape(shape).to(ref.dtype)
    hidden = None if contents.hidden is None else torch.from_numpy(contents.hidden).to(ref.dtype)
    return counter_causal_logits(
        ref, torch.from_numpy(contents.tokens.astype(np.int64)), torch.from_numpy(contents.positions.astype(np.int64)),
        k, v, first, hidden, score, min_gap, blind,
    ).numpy()  # fmt: skip


@pytest.mark.backend
@pytest.mark.parametrize("variant", ["full", "fast"])
@pytest.mark.parametrize("score", ["raw", "logprob"])
@pytest.mark.parametrize("holes", [False, True])
def test_native_matches_twin_on_tiny_models(tiny_path, variant, score, holes):
    ref = ReferenceModel(tiny_path)
    n = 80
    toks = _tokens(n, ref.info.n_vocab, 1)
    keep = sorted({0, 1, 2, n - 1} | set(range(10, 30)) | set(range(40, n, 3))) if holes else None
    model, cache = _engine_cache(tiny_path, toks, keep)
    cc = SurpriseModel(model.info)
    contents = cache_contents(cache, cc, variant)
    got = cc.logits(contents, variant, score)
    want = _twin_from(ref, contents, variant, score)
    assert np.isnan(got[-1]) and np.isnan(want[-1])
    err = np.abs(got[:-1] - want[:-1]).max()
    print(f"{model.info.arch} {variant} {score} holes={holes}: max err {err:.2e}")
    assert err < ATOL
    positions = contents.positions
    budget = len(positions) // 2
    prot = protected_positions(positions, 4)
    assert np.array_equal(
        select_keep(positions, surprise(got), budget, prot), select_keep(positions, surprise(want), budget, prot)
    )


def test_blind_twin_matches_its_definition(tiny_path):
    """Blind: cell i's own input is the mean token embedding, everything else as the paper's pass:
    a plain forward of that embedding at p_i over a cache of the later cells only."""
    ref = ReferenceModel(tiny_path)
    n = 10
    toks = _tokens(n, ref.info.n_vocab, 6)
    rc = ref.new_cache()
    ref.forward(toks, range(n), rc)
    twin = counter_causal_logits(ref, torch.tensor(toks), torch.arange(n), torch.stack(rc.k), torch.stack(rc.v),
                                 blind=True)  # fmt: skip
    neutral = ref.tok_embd.mean(dim=0)
    saved = ref.tok_embd
    for i in range(n - 1):
        later, visible = _later_cells(ref, rc, i, n)
        ref.tok_embd = saved.clone()  # ref.output keeps the original rows (tied or not): x_i is still scored
        ref.tok_embd[toks[i]] = neutral  # the token's own input row replaced, nothing else
        try:
            logits = ref.forward([toks[i]], [i], later, visible=visible)
        finally:
            ref.tok_embd = saved
        assert abs(float(logits[0, toks[i]]) - float(twin[i])) < 1e-9
    plain = counter_causal_logits(ref, torch.tensor(toks), torch.arange(n), torch.stack(rc.k), torch.stack(rc.v))
    assert torch.abs(plain[:-1] - twin[:-1]).max() > 1e-3  # x_i's own input mattered


@pytest.mark.backend
@pytest.mark.parametrize("holes", [False, True])
def test_blind_native_matches_twin(tiny_path, holes):
    ref = ReferenceModel(tiny_path)
    n = 60
    toks = _tokens(n, ref.info.n_vocab, 7)
    keep = sorted({0, 1, 2, n - 1} | set(range(10, 30)) | set(range(35, n, 2))) if holes else None
    model, cache = _engine_cache(tiny_path, toks, keep)
    cc = SurpriseModel(model.info)
    assert np.abs(cc.neutral_input() - ref.tok_embd.mean(dim=0).numpy()).max() < 1e-6  # f32 vs f64 mean
    contents = cache_contents(cache, cc, "full")
    for score in ("raw", "logprob"):
        got = cc.logits(contents, "full", score, blind=True)
        want = _twin_from(ref, contents, "full", score, blind=True)
        err = np.abs(got[:-1] - want[:-1]).max()
        print(f"{model.info.arch} blind {score} holes={holes}: max err {err:.2e}")
        assert err < ATOL
    with pytest.raises(KvliteError, match="blind"):
        cc.logits(cache_contents(cache, cc, "fast"), "fast", blind=True)


@pytest.mark.backend
@pytest.mark.parametrize("block_rows", [1, 7, 32])
def test_attention_blocks_give_the_same_logits(tiny_paths, block_rows):
    """Long caches go through query blocks that each read only the cells they may see."""
    path = tiny_paths["llama"]
    ref = ReferenceModel(path)
    model, cache = _engine_cache(path, _tokens(70, ref.info.n_vocab, 5))
    cc = SurpriseModel(model.info)
    for variant in ("full", "fast"):
        contents = cache_contents(cache, cc, variant)
        for gap in (0, 2):
            got = cc.logits(contents, variant, "raw", min_gap=gap, block_rows=block_rows)
            want = _twin_from(ref, contents, variant, "raw", min_gap=gap)
            assert np.abs(got[: -1 - gap] - want[: -1 - gap]).max() < ATOL


@pytest.mark.backend
@pytest.mark.parametrize("variant", ["full", "fast"])
def test_min_gap_skips_the_nearest_cells(tiny_paths, variant):
    path = tiny_paths["qwen2"]
    ref = ReferenceModel(path)
    model, cache = _engine_cache(path, _tokens(50, ref.info.n_vocab, 4))
    cc = SurpriseModel(model.info)
    contents = cache_contents(cache, cc, variant)
    got = cc.logits(contents, variant, "raw", min_gap=3)
    want = _twin_from(ref, contents, variant, "raw", min_gap=3)
    assert np.all(np.isnan(got[-4:])) and not np.any(np.isnan(got[:-4]))
    assert np.abs(got[:-4] - want[:-4]).max() < ATOL
    assert np.abs(got[:-4] - cc.logits(contents, variant, "raw")[:-4]).max() > 100 * ATOL  # the gap matters
    assert np.all(np.isinf(surprise(got)[-4:]))


@pytest.mark.backend
def test_fast_reads_the_hidden_states_the_cache_kept(tiny_paths):
    """The hidden states kept beside the token buffer are the reference's input of the last layer,
    and they leave with their tokens."""
    path = tiny_paths["llama"]
    ref = ReferenceModel(path)
    toks = _tokens(40, ref.info.n_vocab, 2)
    keep = [0, 1, 2, 3] + list(range(20, 40))
    model, cache = _engine_cache(path, toks, keep)
    rcap: dict = {}
    ref.forward(toks, range(40), ref.new_cache(), capture=rcap)
    want = rcap[("hidden", ref.info.n_layer - 1)].numpy()[keep]
    assert cache.hidden.shape == (len(keep), ref.info.n_embd)
    assert np.abs(cache.hidden - want).max() < 1e-4


def test_bad_inputs(tiny_paths):
    model, cache = _engine_cache(tiny_paths["llama"], _tokens(20, 300, 3))
    cc = SurpriseModel(model.info)
    c = cache_contents(cache, cc, "fast")
    with pytest.raises(KvliteError, match="ascending"):
        cc.logits(CacheContents(c.tokens, c.positions[::-1].copy(), c.k, c.v, c.hidden), "fast")
    with pytest.raises(KvliteError, match="shape"):
        cc.logits(CacheContents(c.tokens, c.positions, np.asarray(c.k)[:, :5], c.v, c.hidden), "fast")
    with pytest.raises(KvliteError, match="hidden"):
        cc.logits(CacheContents(c.tokens, c.positions, c.k, c.v, None), "fast")
    with pytest.raises(KvliteError, match="variant"):
        cc.logits(c, "medium")
    with pytest.raises(KvliteError, match="surprise score"):
        cc.logits(c, "fast", "prob")
    plain = KVCache(Context(model, n_ctx=64))
    plain.append([5, 6, 7])
    with pytest.raises(KvliteError, match="hidden states"):
        cache_contents(plain, cc, "fast")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fast", "full"])
@pytest.mark.model_answer
def test_keep_set_overlap_on_smollm2(smol_path, variant):
    model = Model(smol_path)
    ref = ReferenceModel(smol_path, dtype=torch.float32)
    toks = model.tokenize(
        "The locker code of Orla Bren is 54554. The weather was mild and the market busy, as it is "
        "every Thursday, when farmers bring apples, pears and cheese from the valley. " * 3
    )
    info = model.info
    cap = Capture(info)
    cap.request("hidden", [info.n_layer - 2])
    cache = KVCache(Context(model, n_ctx=len(toks) + 64, capture=cap), hidden_layer=info.n_layer - 2)
    cache.append(toks)
    cc = SurpriseModel(info)
    contents = cache_contents(cache, cc, variant)
    got = cc.logits(contents, variant, "raw")
    want = _twin_from(ref, contents, variant, "raw")
    positions = contents.positions
    budget = len(positions) // 4
    prot = protected_positions(positions, 4)
    a = set(select_keep(positions, surprise(got), budget, prot).tolist())
    b = set(select_keep(positions, surprise(want), budget, prot).tolist())
    overlap = len(a & b) / budget
    print(f"SmolLM2 {variant}: keep-set overlap {overlap:.2f} at budget {budget} of {len(positions)}")
    assert overlap >= 0.8


def test_unsupported_architecture_is_refused(tiny_paths):
    import dataclasses

    from kvlite.models import read_model_info

    info = dataclasses.replace(read_model_info(tiny_paths["llama"]), arch="gemma3")
    with pytest.raises(KvliteError, match="supports llama, qwen2, qwen3, not 'gemma3'"):
        SurpriseModel(info)


@pytest.mark.parametrize("name", ["cc", "cc-fast", "cc-blind"])
def test_gemma3_is_refused_before_any_work(tiny_paths, name):
    """The native pass has no Gemma block (sandwich norms, GeGLU, sliding layers whose cache keeps
    only the window): every counter-causal policy says so when the run is set up."""
    from kvlite.policies import make_policy
    from kvlite.runner import Runner, RunSettings

    with pytest.raises(KvliteError, match="supports llama, qwen2, qwen3, not 'gemma3'"):
        Runner(Model(tiny_paths["gemma3"]), make_policy(name, budget=20), RunSettings(n_ctx=128))
