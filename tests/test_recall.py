"""Issue 61, its first part: evicted cells kept in a host store (KVCache(keep_evicted=True)) and
brought back at their own positions (KVCache.recall), bit for bit. Every architecture's tiny model,
and a 64-wide llama on quantized caches (the blocks llama.cpp stores, rotated or not). What is
compared is llama.cpp's own state export: the recalled cells' K and V bytes against the same cells
before the eviction, and the logits after recalling every evicted cell against a cache that never
evicted (compacted alike: the same cells in the same order, so the same sums)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cache_invariants import check

from kvlite import recall_store
from kvlite.api import Session
from kvlite.cache import KVCache
from kvlite.cached_kv import JointKV
from kvlite.engine import LIVE, Context, Model, Pool, cachetypes, kvstate
from kvlite.errors import KvliteError
from kvlite.policies import LAQ, KNorm, SnapKV
from kvlite.reference.scores import attn_pool
from kvlite.reference.tiny_gguf import TinySpec, write_tiny_gguf
from kvlite.runner import Runner, RunSettings
from kvlite.scoring.aggregate import aggregate
from kvlite.slotfile import read_slot_file, write_slot_file

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


def _recalled_against_before(model: Model, kv_type: str) -> KVCache:
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
    return cache


@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """Every store beyond a cap of 0 MiB: in a file under a cache folder of the test's own."""
    monkeypatch.setenv("KVLITE_CACHE", str(tmp_path))
    recall_store.set_cap(0)
    yield tmp_path / "recall"
    recall_store.set_cap(None)


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


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_a_store_beyond_the_cap_is_a_mapped_file_and_comes_back_bit_for_bit(wide, kv_type, on_disk):
    """--recall-store: past the cap the store is written out and mapped back, not held in the
    process's heap; its file is unlinked once mapped, so nothing is left when the store goes."""
    cache = _recalled_against_before(wide, kv_type)
    assert not recall_store.in_ram(cache.store) and recall_store.ram_bytes() == 0
    assert recall_store.disk_bytes() == kvstate.nbytes(cache.store) > 0
    assert all(isinstance(a.base, np.memmap) for a in cache.store.streams[0].k)
    assert list(on_disk.iterdir()) == []


def test_a_store_that_cannot_go_to_disk_is_one_line(wide, tmp_path, monkeypatch):
    """Past the cap with no folder to write in: a KvliteError naming the folder and what to do, and
    the cache as it was: the cells are kept before they are removed, so nothing was evicted."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KVLITE_CACHE", str(tmp_path / "a-file"))
    recall_store.set_cap(0)
    try:
        cache = KVCache(_context(wide, "f16"), keep_evicted=True)
        cache.append(_tokens(N))
        with pytest.raises(KvliteError, match="cannot keep evicted cells in .*a-file/recall.*KVLITE_CACHE"):
            cache.evict(KEEP)
        assert list(cache.positions()) == list(range(N)) and cache.store is None
        check(cache)
    finally:
        recall_store.set_cap(None)


def test_the_cap_is_the_processs_not_a_conversations(wide, tmp_path, monkeypatch):
    """Two conversations' stores: the first fits the cap and stays in memory, the second would pass
    it and goes to disk; a store that replaces its own earlier self is not counted twice."""
    monkeypatch.setenv("KVLITE_CACHE", str(tmp_path))
    caches = []
    for _ in range(2):
        cache = KVCache(_context(wide, "f16"), keep_evicted=True)
        cache.append(_tokens(N))
        caches.append(cache)
    try:
        caches[0].evict([p for p in range(N) if p not in GONE[:20]])  # 20 cells, to size the cap by
        recall_store.set_cap(1.5 * kvstate.nbytes(caches[0].store) / 2**20)
        caches[0].evict([p for p in range(N) if p not in GONE[:24]])  # 24, replacing itself: in memory
        assert recall_store.in_ram(caches[0].store)
        caches[1].evict(KEEP)
        assert not recall_store.in_ram(caches[1].store) and recall_store.in_ram(caches[0].store)
        assert recall_store.ram_bytes() == kvstate.nbytes(caches[0].store)
    finally:
        recall_store.set_cap(None)


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


# -- what a recall brings back ----------------------------------------------------------------------
BUDGET, RECALL = 48, 8
ATOL_SCORES = 1e-4  # pooled probabilities in f32 (native) against float64 (torch): ~1e-6 seen


def test_joint_keys_are_the_keys_of_a_cache_that_never_evicted(tiny_model):
    """What a recall scores: the resident and the stored keys in position order, bit for bit those a
    cache that kept everything holds."""
    ctx = _context(tiny_model, "f16")
    whole = KVCache(ctx)
    whole.append(_tokens(N))
    want = whole.cached_kv()
    cache = KVCache(_context(tiny_model, "f16"), keep_evicted=True)
    cache.append(_tokens(N))
    cache.evict(KEEP)
    joint = JointKV(cache.cached_kv(), cache.store)
    try:
        assert list(joint.positions) == list(range(N))
        for il in want.layers:
            assert joint.layer_blocks(il)[1].tobytes() == want.layer_blocks(il)[1].tobytes()
    finally:
        joint.close()
        want.close()


@pytest.mark.parametrize("lookahead", [False, True])
def test_recall_brings_back_the_stored_cells_the_turn_attends_most(tiny_paths, lookahead):
    """The cells recalled are the top RECALL of the evicted ones by the torch twin's attention of the
    turn's observed queries over every key (kvlite.reference.scores.attn_pool, normalized per layer
    and head, max over them), computed from a cache that never evicted; with recall_lookahead, the
    queries of the eviction's own lookahead (LAQ's T steps) beside them."""
    model = Model(tiny_paths["llama"])
    tokens = _tokens(200, seed=3)
    policy = LAQ(budget=BUDGET, lookahead=4, workspace=BUDGET) if lookahead else SnapKV(budget=BUDGET)
    runner = Runner(model, policy, RunSettings(n_ctx=512, n_threads=1), recall=RECALL)
    runner.recall_lookahead = lookahead
    runner.feed(tokens)
    kept = set(runner.cache.positions().tolist())
    evicted = np.array(sorted(set(range(len(tokens))) - kept))
    ahead = runner.turn_lookahead if lookahead else []
    assert sum(q.shape[2] for q in ahead) == (4 if lookahead else 0)
    queries = np.concatenate([runner.observed["q"].transpose(0, 2, 1, 3), *ahead], axis=2)
    queries = torch.from_numpy(queries.astype(np.float64))
    whole = KVCache(_context(model, "f16"))
    whole.append(tokens)
    _, k, _ = whole.read_kv(model.info.full_layers)  # [L, n, Hkv * D]
    n_layer, n, _ = k.shape
    keys = torch.from_numpy(k.astype(np.float64).reshape(n_layer, n, model.info.n_head_kv, -1).transpose(0, 2, 1, 3))
    pooled = attn_pool(queries, keys, model.info.kq_scale).numpy()
    want = aggregate(pooled, "max")[evicted]
    order = np.argsort(-want, kind="stable")
    assert want[order[RECALL - 1]] - want[order[RECALL]] > ATOL_SCORES, "no margin at the cut: pick another seed"
    assert runner.recall(room=100) == RECALL
    recalled = set(runner.cache.positions().tolist()) - kept
    assert recalled == set(evicted[order[:RECALL]].tolist())
    check(runner.cache)
    if lookahead:
        # LAQ kept no recent window and dropped the position before the last: llama.cpp takes no
        # token there again, so the last one is not read again and the reply goes on from its logits
        assert len(tokens) - 2 not in runner.cache.positions()
        out, _ = runner.generate(2)
        assert len(out) == 2
        check(runner.cache)
    runner.close()


def test_an_eager_conversation_with_recall_holds_budget_plus_recall(tiny_paths):
    """Each turn evicts to the budget, then brings back at most RECALL cells; what kvlite holds is
    what llama.cpp holds after every turn."""
    session = Session(tiny_paths["llama"], policy=SnapKV(budget=BUDGET), n_ctx=512, n_threads=1)
    conv = session.conversation(evict="eager", recall=RECALL)
    for i, words in enumerate((60, 15, 20)):
        conv.turn(" ".join(f"w{i}{j}" for j in range(words)), 4, None, lambda: False)
        cache = conv.runner.cache
        assert conv.decode_cells <= BUDGET + RECALL  # when the reply began
        assert cache.n_resident <= BUDGET + RECALL + 4  # and the reply's tokens
        check(cache)
    assert "recalled" in conv.last
    with pytest.raises(KvliteError, match="captures none"):
        Session(session.model, policy=KNorm(budget=BUDGET)).conversation(recall=RECALL)


@pytest.mark.parametrize("where", ["ram", "disk"])
def test_a_slot_file_carries_the_store(tiny_paths, tmp_path, where, request):
    """/save and /load (and a server's slot files): the evicted cells come back with the
    conversation, bit for bit, and its recall with them, from a store in memory or on disk."""
    if where == "disk":
        request.getfixturevalue("on_disk")
    model = Model(tiny_paths["llama"])
    session = Session(model, policy=SnapKV(budget=BUDGET), n_ctx=512, n_threads=1)
    conv = session.conversation(evict="eager", recall=RECALL)
    conv.turn(" ".join(f"w{j}" for j in range(60)), 2, None, lambda: False)
    before = conv.runner.cache.stored.copy(), kvstate.build(conv.runner.cache.store)
    path = tmp_path / "saved.slot"
    write_slot_file(path, conv, model)
    saved = read_slot_file(path, str(tmp_path), model.path)
    assert saved.recall == RECALL
    again = Session(model, policy=saved.policy(), n_ctx=512, n_threads=1).conversation("", "eager", saved.recall)
    saved.restore(again, saved.snapshot(None))
    cache = again.runner.cache
    assert np.array_equal(cache.stored, before[0]) and kvstate.build(cache.store) == before[1]
    assert cache.recall(before[0][:3]) == 3
    check(cache)


def test_recall_on_a_pools_lanes(tiny_model):
    """Two conversations on one shared context (a server's --kv-cells), turns interleaved: each
    recalls into its own lane, and what kvlite holds of each is what llama.cpp holds."""
    pool = Pool(tiny_model, n_cells=1024, lanes=3, n_batch=32)
    convs = [Session(tiny_model, policy=SnapKV(budget=BUDGET), pool=pool, n_ctx=512, n_threads=1)
             .conversation(evict="eager", recall=RECALL) for _ in range(2)]  # fmt: skip
    for i in range(2):
        for conv in convs:
            conv.turn(" ".join(f"w{i}{j}" for j in range(40)), 3, None, lambda: False)
            assert conv.last.endswith(f"recalled {RECALL}")
            check(conv.runner.cache)


def test_a_bare_recall_is_the_tune_splits_pick():
    """`--recall` without a number takes RECALL_PICK: the N scripts/pick_recall.py's rule chooses
    from the committed tune-split records, recomputed here (a changed rule or record shows)."""
    import json
    import pathlib
    import sys

    from kvlite.cli import build_parser
    from kvlite.eval import report, tune
    from kvlite.eval.records import read_records
    from kvlite.evict import RECALL_PICK

    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "scripts"))
    import pick_recall

    runs = root / "results-runs" / "recall-tune-smol-1024"
    means = pick_recall.by_recall(tune.tune_only(read_records(runs)))
    gains = {n: report.arm_difference(means, n, 0) for n in pick_recall.RECALLS}
    assert json.loads((runs / "pick.json").read_text())["pick"] == RECALL_PICK
    best = max(gains, key=lambda n: gains[n].mean)
    chosen = [n for n in gains if gains[n].lo > 0 and (n == best or report.arm_difference(means, best, n).lo <= 0)]
    assert min(chosen) == RECALL_PICK
    for command in ("chat", "serve"):
        assert build_parser().parse_args([command, "--recall"]).recall == RECALL_PICK
        assert build_parser().parse_args([command, "--recall", "7"]).recall == 7
