"""Issue 61, its first part: evicted cells kept in a host store (KVCache(keep_evicted=True)) and
brought back at their own positions (KVCache.recall), bit for bit. Every architecture's tiny model,
and a 64-wide llama on quantized caches (the blocks llama.cpp stores, rotated or not). What is
compared is llama.cpp's own state export: the recalled cells' K and V bytes against the same cells
before the eviction, and the logits after recalling every evicted cell against a cache that never
evicted (compacted alike: the same cells in the same order, so the same sums)."""

from __future__ import annotations

import numpy as np
import pytest

from kvlite.cache import KVCache
from kvlite.engine import LIVE, Context, Model, cachetypes, kvstate
from kvlite.errors import KvliteError
from kvlite.reference.tiny_gguf import TinySpec, write_tiny_gguf

N = 60
KEEP = sorted({0, 1, 2, 3, N - 1} | set(range(10, 20)) | set(range(50, 55)))
GONE = sorted(set(range(N)) - set(KEEP))
NEW = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Model:
    spec = TinySpec(arch="llama", n_layer=2, n_head=4, n_head_kv=2, head_dim=64, seed=7)
    return Model(str(write_tiny_gguf(tmp_path_factory.mktemp("recall") / "llama64.gguf", spec)))


def _tokens(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, size=n)]


def _cells(ctx: Context) -> list[dict[int, bytes]]:
    """Each section's cells by position: the K and V bytes of every layer, as llama.cpp exports them."""
    state = kvstate.parse(ctx.state_get(LIVE))
    out = []
    for (st,) in state.sections:
        rows = {} if st is None else {int(p): b"".join(a[i].tobytes() for a in (*st.k, *st.v))
                                      for i, p in enumerate(st.pos)}  # fmt: skip
        out.append(rows)
    return out


def _context(model: Model, kv_type: str) -> Context:
    fa = "on" if kv_type != "f16" else "off"  # a quantized V needs flash attention
    return Context(model, n_ctx=256, n_batch=64, n_threads=1, type_k=kv_type, type_v=kv_type, flash_attn=fa)


def _recalled_against_before(model: Model, kv_type: str) -> None:
    ctx = _context(model, kv_type)
    cache = KVCache(ctx, keep_evicted=True)
    cache.append(_tokens(N))
    before = _cells(ctx)
    cache.evict(KEEP)
    cache.compact()
    assert list(cache.stored) == GONE and kvstate.nbytes(cache.store) > 0
    some = GONE[::3]
    assert cache.recall(some) == len(some)
    after = _cells(ctx)
    assert sorted(after[0]) == sorted(KEEP + some) and list(cache.positions()) == sorted(KEEP + some)
    for section, rows in enumerate(after):
        assert all(rows[p] == before[section][p] for p in rows), f"section {section}: a cell changed"
    assert list(cache.stored) == sorted(set(GONE) - set(some))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_recalled_cells_are_the_evicted_ones_bit_for_bit(tiny_paths, arch):
    if arch not in tiny_paths:
        pytest.skip(f"no tiny {arch} fixture")
    _recalled_against_before(Model(tiny_paths[arch]), "f16")


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("rotated", [True, False])
def test_quantized_cells_come_back_as_stored(wide, kv_type, rotated, monkeypatch):
    if not rotated:
        monkeypatch.setenv(cachetypes.ROTATION_ENV, "1")
    _recalled_against_before(wide, kv_type)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_recalling_every_evicted_cell_is_the_cache_that_never_evicted(tiny_paths, arch):
    """Logits after the evicted cells all came back equal, to the bit, those of a cache that kept
    them, both compacted (cells in position order from cell 0)."""
    model = Model(tiny_paths[arch])
    logits = []
    for evict in (False, True):
        ctx = _context(model, "f16")
        cache = KVCache(ctx, keep_evicted=True)
        cache.append(_tokens(N))
        if evict:
            cache.evict(KEEP)
            cache.recall(GONE)
        cache.compact()
        cache.append(NEW, logits="all")
        logits.append(np.stack([ctx.logits(i) for i in range(len(NEW))]))
    np.testing.assert_array_equal(logits[0], logits[1])


def test_a_sliding_layers_cells_come_back_only_inside_its_window(tiny_paths):
    """Gemma 3's sliding layers hold the last n_swa positions: a cell evicted inside the window
    and recalled after the window moved on comes back to the global layers alone."""
    model = Model(tiny_paths["gemma3"])
    window = model.info.n_swa
    ctx = _context(model, "f16")
    cache = KVCache(ctx, keep_evicted=True)
    cache.append(_tokens(N))
    inside = N - 3  # in the window when evicted
    cache.evict([p for p in range(N) if p != inside])
    cache.append(_tokens(window, seed=2))  # the window moves past it
    cache.recall([inside])
    global_rows, sliding_rows = _cells(ctx)
    assert inside in global_rows and inside not in sliding_rows
    assert max(sliding_rows) - min(sliding_rows) < window


def test_recall_refuses_what_the_store_does_not_hold(tiny_model):
    ctx = _context(tiny_model, "f16")
    cache = KVCache(ctx, keep_evicted=True)
    cache.append(_tokens(N))
    cache.evict(KEEP)
    with pytest.raises(KvliteError, match="the store does not hold"):
        cache.recall([KEEP[1]])
    plain = KVCache(_context(tiny_model, "f16"))  # keeps nothing unless asked
    plain.append(_tokens(N))
    plain.evict(KEEP)
    assert plain.store is None and not len(plain.stored)


def test_a_forgotten_turn_leaves_no_stored_cell_behind(tiny_model):
    """truncate (a turn interrupted while it was read) forgets the store's cells from there on too
    (from the last resident position below it on, as it forgets the sequence's)."""
    ctx = _context(tiny_model, "f16")
    cache = KVCache(ctx, keep_evicted=True)
    cache.append(_tokens(N))
    cache.evict(KEEP)
    cache.truncate(40)
    end = max(p for p in KEEP if p < 40) + 1
    assert cache.n_pos == end and list(cache.stored) == [p for p in GONE if p < end]
