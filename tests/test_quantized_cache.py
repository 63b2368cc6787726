"""Quantized and bf16 KV caches (-ctk/-ctv): what kvlite reads back is what the model made, every
score equals its torch twin's from the same bytes, and compaction moves cells byte for byte.

The fixtures: a llama with 64-wide heads, on which llama.cpp rotates what a quantized cache stores
(cachetypes.rotations), and qwen2's 32-wide heads, on which it does not. Rotation is switched off
with llama.cpp's own LLAMA_ATTN_ROT_DISABLE, read when a context is made.

Tolerances. The twin dequantizes with gguf-py (numpy) where kvlite calls ggml's C: both compute
d * q in f32, so rows agree to f32 rounding of the rotation's 64-term sums (|k| ~ 10: 1e-5).
Against the model's own f32 keys the error is the type's: q8_0 rounds each block to 1/254 of its
largest value (relative error ~0.5%), q4_0 to 1/16 (~8%); the bounds below are ~2x those seen.
Keys read without undoing the rotation are off by ~100%: the test that catches it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlite.cache import KVCache
from kvlite.engine import LIVE, Capture, Context, Model, cachetypes, kvstate
from kvlite.errors import KvliteError
from kvlite.native import native
from kvlite.policies import POLICIES, KNorm, make_policy
from kvlite.policies.observe import pooled_layer
from kvlite.reference.counter_causal import counter_causal_logits
from kvlite.reference.model import ReferenceModel
from kvlite.reference.quant import cache_rows, hadamard
from kvlite.reference.scores import attn_pool, knorm
from kvlite.reference.tiny_gguf import TinySpec, write_tiny_gguf
from kvlite.runner import Runner, RunSettings
from kvlite.scoring.surprise import SurpriseModel, cache_contents

QUANTIZED = ["q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
REL_ERR = {"q8_0": 0.012, "q4_0": 0.18, "bf16": 0.004}  # of layer 0's keys and values against the model's
ATOL_ROWS = 1e-4
ATOL_SCORES = 1e-4  # pooled probabilities (O(0.01-1)) in f32 against float64: ~1e-6 seen
ATOL_CC = 1e-3  # counter-causal logits, as tests/test_counter_causal.py holds them on f32 caches


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tiny-q")
    specs = {
        "llama64": TinySpec(arch="llama", n_layer=2, n_head=4, n_head_kv=2, head_dim=64, seed=7),
        "qwen2": TinySpec(arch="qwen2", n_layer=2, n_head=4, n_head_kv=1, head_dim=32, rope_base=1e6, seed=2),
    }
    return {name: str(write_tiny_gguf(d / f"{name}.gguf", spec)) for name, spec in specs.items()}


@pytest.fixture(params=["rotated", "not rotated"])
def rotation(request, monkeypatch) -> bool:
    if request.param == "not rotated":
        monkeypatch.setenv(cachetypes.ROTATION_ENV, "1")
    return request.param == "rotated"


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, size=n)]


def _read(path: str, kv_type: str, tokens: list[int], capture: Capture | None = None):
    model = Model(path)
    ctx = Context(model, n_ctx=256, n_batch=64, type_k=kv_type, type_v=kv_type, capture=capture)
    cache = KVCache(ctx)
    cache.append(tokens)
    return model, ctx, cache


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_rotation_follows_llamacpps_rule(monkeypatch):
    monkeypatch.delenv(cachetypes.ROTATION_ENV, raising=False)
    assert cachetypes.rotations("q8_0", "q8_0", 64) == (64, 64)
    assert cachetypes.rotations("q4_0", "f16", 128) == (128, 0)
    assert cachetypes.rotations("f16", "q5_1", 256) == (0, 64)
    assert cachetypes.rotations("q8_0", "q8_0", 192) == (64, 64)  # the largest power of two dividing 192
    assert cachetypes.rotations("q8_0", "q8_0", 32) == (0, 0)
    assert cachetypes.rotations("bf16", "bf16", 64) == (0, 0)  # not a quantized type
    for value, disabled in (("1", True), ("-1", True), ("0", False), ("true", False), ("", False)):
        monkeypatch.setenv(cachetypes.ROTATION_ENV, value)  # atoi's reading
        assert cachetypes.rotation_disabled() is disabled
    for n in (64, 128, 256):
        h = cachetypes.hadamard(n)
        np.testing.assert_allclose(h, hadamard(n).numpy(), atol=1e-7)
        np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-5)


@pytest.mark.backend
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "bf16"])
def test_cached_vectors_are_the_models(paths, kv_type, rotation):
    """Layer 0's keys and values (made from the embeddings alone) against the reference model's."""
    tokens = _tokens(48, 0)
    model, ctx, cache = _read(paths["llama64"], kv_type, tokens)
    quantized = cachetypes.quantized(kv_type)
    assert ctx.rotations == ((64, 64) if rotation and quantized else (0, 0))
    assert ctx.flash_attn == quantized  # auto: on for a quantized V only
    ref = ReferenceModel(paths["llama64"])
    rc = ref.new_cache()
    ref.forward(tokens, range(len(tokens)), rc)
    want_k, want_v = (x[0].reshape(len(tokens), -1).numpy() for x in (rc.k, rc.v))
    kv = cache.cached_kv()
    try:
        k, v = kv.k_rows(0), kv.v_rows(0)
        assert k.dtype == np.float32
        print(f"{kv_type} rotated={rotation}: rel err k {_rel(k, want_k):.4f} v {_rel(v, want_v):.4f}")
        assert _rel(k, want_k) < REL_ERR[kv_type] and _rel(v, want_v) < REL_ERR[kv_type]
        if ctx.rotations[0]:  # read without undoing the rotation, the keys are someone else's
            raw = native().to_float(kv.file.layout.k_types[0][0], kv.file.k(0, kv.order), k.shape[1])
            assert _rel(raw, want_k) > 0.5
    finally:
        kv.close()


@pytest.mark.backend
@pytest.mark.parametrize("kv_type", [*QUANTIZED, "bf16"])
@pytest.mark.parametrize("name", ["llama64", "qwen2"])
def test_rows_match_the_twin(paths, name, kv_type, rotation):
    """Every layer's K and V rows as kvlite reads them against the twin's reading of the same bytes."""
    model, ctx, cache = _read(paths[name], kv_type, _tokens(40, 1))
    stream = kvstate.parse(ctx.state_get(LIVE)).streams[0]
    kv = cache.cached_kv()
    try:
        for il in range(model.info.n_layer):
            k = (kv.k_rows(il), stream.k[il], stream.k_types[il], ctx.rotations[0])
            v = (kv.v_rows(il), stream.v[il], stream.v_types[il], ctx.rotations[1])
            for got, raw, desc, rot in (k, v):
                want = cache_rows(raw, desc[0], got.shape[1], rot).numpy()
                np.testing.assert_allclose(got, want, atol=ATOL_ROWS, rtol=0)
    finally:
        kv.close()


@pytest.mark.backend
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "bf16"])
def test_scores_match_the_twin(paths, kv_type, rotation):
    """Attention pooling (EchoKV, LAQ, SnapKV, KVzip's kernel) of captured queries over the cached
    keys, and K-norm, each against its torch twin over the twin's keys from the same bytes."""
    path = paths["llama64"]
    info = Model(path).info
    cap = Capture(info)
    cap.request("q", range(info.n_layer))
    tokens = _tokens(60, 2)
    model, ctx, cache = _read(path, kv_type, tokens, capture=cap)
    stream = kvstate.parse(ctx.state_get(LIVE)).streams[0]
    n_kv, d = info.n_head_kv, info.head_dim
    twin_k = torch.stack([cache_rows(stream.k[il], stream.k_types[il][0], n_kv * d, ctx.rotations[0])
                          .reshape(-1, n_kv, d).permute(1, 0, 2) for il in range(info.n_layer)])  # fmt: skip
    q = np.stack([cap.get("q", il) for il in range(info.n_layer)])[:, -8:].transpose(0, 2, 1, 3).copy()
    kv = cache.cached_kv()
    try:
        keys = np.stack([kv.layer(il) for il in range(info.n_layer)])
        got = native().attn_pool(q, keys, info.kq_scale, pool_kernel=3)
        # what policies call: the blocks as stored, the queries rotated instead of the keys
        blocks = np.concatenate([pooled_layer(q[il : il + 1], kv, il, info.kq_scale, 3) for il in range(info.n_layer)])
    finally:
        kv.close()
    want = attn_pool(torch.from_numpy(q).double(), twin_k, info.kq_scale, pool_kernel=3).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL_SCORES, rtol=0)
    np.testing.assert_allclose(blocks, want, atol=ATOL_SCORES, rtol=0)

    runner = Runner(model, KNorm(budget=30), RunSettings(n_ctx=256, chunk=64, type_k=kv_type, type_v=kv_type))
    try:
        runner.feed(tokens)
        np.testing.assert_allclose(runner.last_eviction.scores, knorm(twin_k).numpy(), atol=ATOL_ROWS, rtol=0)
    finally:
        runner.close()


@pytest.mark.backend
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_counter_causal_matches_the_twin(paths, kv_type, rotation):
    """The counter-causal pass reads K and V: against the twin run on the twin's reading of the bytes,
    with holes left by an eviction."""
    path = paths["llama64"]
    tokens = _tokens(70, 6)
    model, ctx, cache = _read(path, kv_type, tokens)
    cache.evict(sorted({0, 1, 2, 69} | set(range(10, 40)) | set(range(45, 69, 2))))
    stream = kvstate.parse(ctx.state_get(LIVE)).streams[0]
    order = np.argsort(stream.pos, kind="stable")
    info = model.info
    shape = (len(order), info.n_head_kv, info.head_dim)
    k, v = (torch.stack([cache_rows(rows[il][order], types[il][0], shape[1] * shape[2], rot).reshape(shape)
                         for il in range(info.n_layer)])
            for rows, types, rot in ((stream.k, stream.k_types, ctx.rotations[0]),
                                     (stream.v, stream.v_types, ctx.rotations[1])))  # fmt: skip
    cc = SurpriseModel(info)
    got = cc.logits(cache_contents(cache, cc, "full"), "full", "raw")
    ref = ReferenceModel(path)
    positions = torch.from_numpy(stream.pos[order].astype(np.int64))
    toks = torch.tensor([tokens[p] for p in stream.pos[order]])
    want = counter_causal_logits(ref, toks, positions, k.to(ref.dtype), v.to(ref.dtype)).numpy()
    assert np.isnan(got[-1]) and np.isnan(want[-1])
    np.testing.assert_allclose(got[:-1], want[:-1], atol=ATOL_CC, rtol=0)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "bf16"])
@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"full"}))
def test_every_policy_evicts_on_every_type(paths, name, kv_type):
    """Each policy scores a quantized cache and leaves what it says it kept, as llama.cpp holds it."""
    model = Model(paths["llama64"])
    policy = make_policy(name, budget=48)
    runner = Runner(model, policy, RunSettings(n_ctx=512, chunk=64, type_k=kv_type, type_v=kv_type))
    try:
        runner.feed(_tokens(120, 3))
        out, _ = runner.generate(4)
        positions = runner.cache.positions()
        assert np.array_equal(positions, runner.cache.llama_positions(LIVE))
        assert runner.last_eviction is not None and len(runner.last_eviction.kept) == 48
        assert len(out) == 4
    finally:
        runner.close()


@pytest.mark.backend
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_compaction_moves_quantized_cells_byte_for_byte(paths, kv_type, rotation):
    model = Model(paths["llama64"])
    ctx = Context(model, n_ctx=256, n_batch=64, type_k=kv_type, type_v=kv_type)
    cache = KVCache(ctx)
    cache.append(_tokens(80, 4))
    keep = [p for p in range(80) if p < 4 or p % 5 == 0 or 30 <= p < 41 or p == 79]
    cache.evict(keep)
    before = kvstate.parse(ctx.state_get(LIVE)).streams[0]
    cache.compact()
    after = kvstate.parse(ctx.state_get(LIVE)).streams[0]
    order = np.argsort(before.pos, kind="stable")
    assert np.array_equal(after.pos, before.pos[order]) and np.array_equal(after.pos, keep)
    assert before.k[0].dtype == np.uint8  # the blocks as stored
    for rows_before, rows_after in zip(before.k + before.v, after.k + after.v):
        assert rows_before[order].tobytes() == rows_after.tobytes()
    cache.append(_tokens(3, 5))  # and it still decodes after them
    assert cache.llama_positions(LIVE)[-1] == 82


@pytest.mark.backend
def test_combinations_llamacpp_cannot_run_are_one_line_errors(paths, tmp_path_factory):
    model = Model(paths["llama64"])
    with pytest.raises(KvliteError, match="needs flash attention"):
        Context(model, n_ctx=256, type_v="q8_0", flash_attn="off")
    with pytest.raises(KvliteError, match="cache types are"):
        RunSettings(type_k="q2_k")
    with pytest.raises(KvliteError, match="use on, off or auto"):
        RunSettings(flash_attn="sometimes")
    narrow = write_tiny_gguf(tmp_path_factory.mktemp("narrow") / "n.gguf", TinySpec(head_dim=16))
    with pytest.raises(KvliteError, match="blocks of 32 values; this model's heads are 16 wide"):
        Context(Model(str(narrow)), n_ctx=256, type_k="q8_0")
    assert RunSettings(flash_attn="enabled").flash_attn == "on"  # llama.cpp's spellings
    ctx = Context(model, n_ctx=256, type_k="q8_0", flash_attn="off")  # a quantized K alone runs without
    assert not ctx.flash_attn and ctx.rotations == (64, 0)
