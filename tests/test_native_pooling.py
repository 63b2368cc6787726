"""The native Eq. 3 kernel against its torch twin.

Tolerance: the kernel computes in f32 (f16 keys are widened exactly); the twin in float64. Each
output is a sum of n_q * group softmax probabilities (<= n_q * group), so an f32 result carries
~1e-7 relative error per term; 1e-5 absolute holds with margin for n_q * group <= 56."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlite.cache import KVCache
from kvlite.engine import Capture, Context, Model, kvstate
from kvlite.errors import KvliteError
from kvlite.native import Native, native
from kvlite.reference.scores import attn_pool

ATOL = 1e-5


def _inputs(n_layer, n_head, n_head_kv, n_q, n_keys, head_dim, k_dtype, seed):
    rng = np.random.default_rng(seed)
    q = (3 * rng.standard_normal((n_layer, n_head, n_q, head_dim))).astype(np.float32)
    k = (3 * rng.standard_normal((n_layer, n_head_kv, n_keys, head_dim))).astype(k_dtype)
    return q, k


def _twin(q, k, key_mask=None, pool_kernel=0):
    mask = None if key_mask is None else torch.from_numpy(np.asarray(key_mask, bool))
    qt, kt = torch.from_numpy(q).double(), torch.from_numpy(k.astype(np.float64))
    return attn_pool(qt, kt, key_mask=mask, pool_kernel=pool_kernel).numpy()


@pytest.mark.backend
@pytest.mark.parametrize(
    "n_layer,n_head,n_head_kv,n_q,n_keys,head_dim,k_dtype",
    [
        (1, 4, 4, 1, 7, 16, np.float32),  # GQA ratio 1
        (3, 9, 3, 8, 300, 64, np.float16),  # ratio 3, SmolLM2-like heads
        (2, 14, 2, 5, 1000, 64, np.float32),  # ratio 7, Qwen2.5-like heads
        (2, 7, 1, 3, 33, 32, np.float16),
    ],
)
@pytest.mark.parametrize("chunk", [0, 64, 100])  # one pass; chunk boundaries inside; 100 | 300 and 1000
def test_attn_pool_matches_torch(n_layer, n_head, n_head_kv, n_q, n_keys, head_dim, k_dtype, chunk):
    q, k = _inputs(n_layer, n_head, n_head_kv, n_q, n_keys, head_dim, k_dtype, n_keys)
    got = native().attn_pool(q, k, chunk=chunk)
    assert got.shape == (n_layer, n_head_kv, n_keys)
    np.testing.assert_allclose(got, _twin(q, k), atol=ATOL, rtol=0)
    # each group's scores sum to its number of queries
    np.testing.assert_allclose(got.sum(-1), n_q * n_head // n_head_kv, rtol=1e-5)


@pytest.mark.backend
@pytest.mark.parametrize("chunk", [0, 16, 50])
@pytest.mark.parametrize("pool_kernel", [0, 3, 7])
def test_attn_pool_masked_cells_and_smoothing(chunk, pool_kernel):
    q, k = _inputs(2, 9, 3, 4, 150, 32, np.float16, 7)
    rng = np.random.default_rng(8)
    mask = rng.random(150) > 0.4
    mask[16:32] = False  # a whole chunk of 16 masked: its log-sum-exp must not poison the rest
    got = native().attn_pool(q, k, key_mask=mask, chunk=chunk, pool_kernel=pool_kernel)
    want = _twin(q, k, key_mask=mask, pool_kernel=pool_kernel)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    if pool_kernel == 0:
        assert np.all(got[:, :, ~mask] == 0)


# KVzip's score: the largest probability over a group's queries, each a single f32 softmax
# probability (<= 1), so 1e-5 holds with the same margin as the sums above.
@pytest.mark.backend
@pytest.mark.parametrize(
    "n_head,n_head_kv,n_q,n_keys,k_dtype,causal",
    [(4, 4, 6, 20, np.float32, False), (9, 3, 40, 120, np.float16, True), (14, 2, 25, 25, np.float32, True),
     (7, 1, 3, 500, np.float16, True)],
)  # fmt: skip
def test_attn_pool_max_and_causal_tail_match_torch(n_head, n_head_kv, n_q, n_keys, k_dtype, causal):
    q, k = _inputs(2, n_head, n_head_kv, n_q, n_keys, 32, k_dtype, n_keys + 1)
    tail = n_q if causal else 0
    got = native().attn_pool(q, k, reduce="max", causal_tail=tail)
    qt, kt = torch.from_numpy(q).double(), torch.from_numpy(k.astype(np.float64))
    want = attn_pool(qt, kt, reduce="max", causal_tail=tail).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert np.all(got <= 1 + 1e-6)
    if causal:  # the last tail key is seen by the last query only: the sum is over its heads alone
        summed = native().attn_pool(q, k, causal_tail=tail)
        assert np.all(summed[..., -1] <= got[..., -1] * (n_head / n_head_kv) + 1e-6)
    with pytest.raises(KvliteError, match="causal tail"):
        native().attn_pool(q, k, causal_tail=n_q + 1 if n_q + 1 <= n_keys else n_q - 1)


@pytest.mark.backend
@pytest.mark.parametrize("reduce,causal,pool_kernel", [("sum", False, 7), ("max", True, 0), ("sum", True, 3)])
def test_attn_pool_in_query_blocks_matches_torch(reduce, causal, pool_kernel):
    """Queries whose probabilities would pass the kernel's 8 MB go in blocks (here 4096 keys x 8
    heads: 64 queries a block, so 300 queries make four blocks of 64 and one of 44) added up, or maxed,
    on the host; pooling follows. Tolerance: a sum of up to 300 x 4 f32 probabilities carries at
    most n * eps = 1200 * 6e-8 = 7e-5 relative error, so rtol 1e-4 (atol 1e-6 for the near-zero)."""
    q, k = _inputs(2, 8, 2, 300, 4096, 16, np.float16, 5)
    tail = 300 if causal else 0
    got = native().attn_pool(q, k, reduce=reduce, causal_tail=tail, pool_kernel=pool_kernel)
    qt, kt = torch.from_numpy(q).double(), torch.from_numpy(k.astype(np.float64))
    want = attn_pool(qt, kt, reduce=reduce, causal_tail=tail, pool_kernel=pool_kernel).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.backend
def test_attn_pool_on_captured_queries_and_cached_keys(tiny_paths):
    """Real inputs: post-RoPE queries captured from llama.cpp and keys read from its cache."""
    model = Model(tiny_paths["llama"])
    info = model.info
    cap = Capture(info)
    cap.request("q", range(info.n_layer))
    ctx = Context(model, n_ctx=128, n_batch=64, capture=cap)
    cache = KVCache(ctx)
    cache.append(list(range(3, 53)))
    q_all = np.stack([cap.get("q", il) for il in range(info.n_layer)])  # [L, T, H, D]
    q = np.ascontiguousarray(q_all[:, -4:].transpose(0, 2, 1, 3))  # last 4 queries: [L, H, 4, D]
    stream = kvstate.parse(ctx.state_get(0)).streams[0]
    k = np.stack([kl.reshape(-1, info.n_head_kv, info.head_dim).transpose(1, 0, 2) for kl in stream.k])
    got = native().attn_pool(q, k)
    want = attn_pool(torch.from_numpy(q).double(), torch.from_numpy(k.astype(np.float64))).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_attn_pool_rejects_bad_input():
    n = native()
    with pytest.raises(KvliteError, match="odd"):
        n.attn_pool(np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 5, 8), np.float32), pool_kernel=4)
    with pytest.raises(KvliteError, match="hides every key"):
        n.attn_pool(np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 5, 8), np.float32), key_mask=np.zeros(5))
    with pytest.raises(KvliteError, match="key_mask"):
        n.attn_pool(np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 5, 8), np.float32), key_mask=np.ones(4))
    q = np.zeros((2, 6, 1, 16), np.float32)
    with pytest.raises(KvliteError, match="do not match"):
        n.attn_pool(q, np.zeros((2, 4, 5, 16), np.float32))  # 6 heads over 4 KV heads
    with pytest.raises(KvliteError, match="do not match"):
        n.attn_pool(q, np.zeros((2, 2, 5, 8), np.float32))  # head_dim
    with pytest.raises(KvliteError, match="float32 or float16"):
        n.attn_pool(q, np.zeros((2, 2, 5, 16), np.float64))
    with pytest.raises(KvliteError, match="must be float32"):
        n.attn_pool(q.astype(np.float64), np.zeros((2, 2, 5, 16), np.float32))


def test_missing_or_foreign_library_is_a_clear_error(tmp_path):
    with pytest.raises(KvliteError, match="cannot load"):
        Native(path=tmp_path / "libkvlite_native.so")
    # a real shared library that is not kvlite's
    import pathlib

    import llama_cpp

    foreign = pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so.0"
    with pytest.raises(KvliteError, match="not kvlite's native library"):
        Native(path=foreign)


def test_stale_library_is_refused(monkeypatch):
    import kvlite.native as kn

    monkeypatch.setattr(kn, "ABI_VERSION", kn.ABI_VERSION + 1)  # this kvlite expects a newer library
    with pytest.raises(KvliteError, match="stale"):
        Native()


@pytest.mark.backend
def test_the_kernels_run_on_the_threads_the_context_decodes_with(tiny_paths):
    """-t reaches the score kernels: a context sets the CPU backend's thread count of kvlite's
    library to its own (scripts/bench_scoring.py's (e) measures what that buys)."""

    model = Model(tiny_paths["llama"])
    for n in (1, 2, 1):
        Context(model, n_ctx=64, n_threads=n)
        assert native().n_threads == n
    with pytest.raises(KvliteError, match="-t must be a positive number of threads"):
        native().set_threads(0)
    with pytest.raises(KvliteError, match=r"-t must be in 1\.\.512"):  # ggml's thread pool holds 512
        native().set_threads(100_000)
