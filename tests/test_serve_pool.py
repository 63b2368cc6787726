"""`kvlite serve --kv-cells N` (issue 31): one pool of N cells that every slot's conversation
shares. When a turn needs cells the pool does not have free, the least recently used other
conversations are parked in host memory and restored when they are next asked; the client sees
only the time that takes. A real uvicorn server on the tiny chat fixture, in this process, so the
pool's cells can be held to llama.cpp's own state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import numpy as np
import pytest
from test_serve import AUTH, KEY, Live

from kvlite.engine import LIVE, Model
from kvlite.errors import KvliteError
from kvlite.serve import ServeConfig, Server
from kvlite.settings import RunSettings

WORDS = [
    "amber",
    "basil",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lantern",
    "meadow",
]


# Replies compared across a pool and separate contexts, which sum in other orders: f16 cells round
# that noise to the next f16 value now and then, a step of up to 2^-10 (test_pool's concurrency
# test measures it); on f32 cells it was 25 to 100 times smaller there.
SAME = RunSettings(n_ctx=384, type_k="f32", type_v="f32")


def message(i: int, n_words: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n_words)) + "?"


def ask(live: Live, messages: list[dict]) -> str:
    r = live.post("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def converse(live: Live, order: list[int], history: dict | None = None) -> dict[int, list[str]]:
    """Conversations by index, one turn each in `order` (a later turn continues the messages so far,
    kept in `history`)."""
    history = {} if history is None else history
    replies: dict[int, list[str]] = {}
    for i in order:
        msgs = history.setdefault(i, [])
        msgs.append({"role": "user", "content": message(i + len(msgs), 20 if not msgs else 4)})
        reply = ask(live, msgs)
        msgs.append({"role": "assistant", "content": reply})
        replies.setdefault(i, []).append(reply)
    return replies


@pytest.fixture(scope="module")
def chat_model(tiny_paths) -> Model:
    return Model(tiny_paths["llama"])


def test_a_pool_parks_the_least_recently_used_and_answers_as_separate_contexts_do(chat_model):
    """Four conversations of 200-300 cells in a pool of 512 (-c 384 each): a turn that does not fit
    parks the least recently used others, and a parked conversation's next turn brings it back.
    Every reply is the reply a server of per-slot contexts gives (the full cache: no choice among
    near-equal scores that the pool's other summation order could tip)."""
    order = [0, 1, 2, 3, 0, 1, 3]
    settings = SAME
    separate = Live(Server(ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings), model=chat_model))
    try:
        expected = converse(separate, order)
    finally:
        separate.stop()
    cfg = ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings, kv_cells=512)
    live = Live(Server(cfg, model=chat_model))
    try:
        assert converse(live, order) == expected
        server = live.server
        assert server.metrics.parked >= 2 and server.metrics.restored >= 1
        state = httpx.get(live.url + "/slots", headers=AUTH).json()
        assert any(s["parked"] for s in state) and sum(s["resident_cells"] for s in state) <= 512
        for slot in server.slots:  # what each resident conversation holds is what llama.cpp holds
            if slot.conversation and not slot.parked:
                cache = slot.conversation.runner.cache
                assert np.array_equal(cache.llama_positions(LIVE), cache.positions())
            elif slot.parked:
                assert len(slot.conversation.runner.cache.llama_positions(LIVE)) == 0
        assert server.pool.ctx.cells_in_use() == sum(s["resident_cells"] for s in state)
        metrics = httpx.get(live.url + "/metrics", headers=AUTH).text
        assert f"kvlite_conversations_parked_total {server.metrics.parked}" in metrics
        # the parked caches' host memory: their cells in f32 (SAME: 3 layers x 2 KV heads x 16 dims x K and
        # V x 4 bytes), beside llama.cpp's state headers and kvlite's bookkeeping
        parked = {s.id: s.parked[0].cells for s in server.slots if s.parked}
        for s in state:
            if s["id"] in parked:
                assert 768 * parked[s["id"]] <= s["parked_bytes"] <= 768 * parked[s["id"]] + 16384, s
        total = sum(s["parked_bytes"] for s in state)
        assert f"kvlite_parked_bytes {total}\n" in metrics and 0 < total <= server.metrics.parked_bytes_peak
        seconds = {k: float(v) for k, v in (line.split() for line in metrics.splitlines() if "_seconds_total" in line
                                                  and not line.startswith("#"))}  # fmt: skip
        assert 0 == seconds["kvlite_evict_seconds_total"] < seconds["kvlite_prefill_seconds_total"]  # full: no eviction
        assert seconds["kvlite_decode_seconds_total"] > 0
    finally:
        live.stop()


def test_a_cap_beyond_the_pool_is_refused(chat_model):
    cfg = ServeConfig(api_key=KEY, slots=2, n_predict=16, settings=RunSettings(n_ctx=1024), kv_cells=512)
    live = Live(Server(cfg, model=chat_model))
    try:
        r = live.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "does not fit in --kv-cells 512" in r.json()["error"]["message"]
    finally:
        live.stop()
    with pytest.raises(KvliteError, match="--kv-cells"):
        ServeConfig(kv_cells=-5)


def test_idle_conversations_leave_the_pool_for_a_turn(chat_model):
    """A pool with room for all: each turn still parks the conversations that are idle, so the pool
    holds only the running turn's cells (attention spans its highest cell in use), and an idle one
    comes back on its next turn with the reply per-slot contexts give."""
    order = [0, 1, 2, 0]
    separate = Live(Server(ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=SAME), model=chat_model))
    try:
        expected = converse(separate, order)
    finally:
        separate.stop()
    live = Live(Server(ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=SAME, kv_cells=4096), model=chat_model))
    try:
        history: dict = {}
        converse(live, order[:2], history)
        server = live.server
        first, second = (next(s for s in server.slots if s.messages == history[i]) for i in (0, 1))
        assert first.parked and not second.parked and server.metrics.parked == 1
        assert server.pool.ctx.cells_in_use() == second.resident > 0
        assert converse(live, order[2:], history) == {i: expected[i][-1:] for i in order[2:]}
        assert server.metrics.parked == 3 and server.metrics.restored == 1
        assert server.pool.ctx.cells_in_use() == first.resident and not first.parked
    finally:
        live.stop()


def test_a_parked_conversation_saved_to_a_file_continues_in_another_slot(chat_model, tmp_path):
    """A parked conversation's slot file (its parked cache) restored into another slot of a full
    pool: the restore parks what it needs, and the next turn continues from the restored cells with
    the reply separate contexts give."""
    settings = SAME
    separate = Live(Server(ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings), model=chat_model))
    try:
        expected = converse(separate, [0, 1, 2, 3, 0])
    finally:
        separate.stop()
    cfg = ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings, kv_cells=512,
                      slot_save_path=str(tmp_path))  # fmt: skip
    live = Live(Server(cfg, model=chat_model))
    try:
        history: dict = {}
        converse(live, [0, 1, 2, 3], history)
        server = live.server
        parked = next(s for s in server.slots if s.parked and s.messages == history[0])
        saved = live.post(f"/slots/{parked.id}?action=save", {"filename": "p.slot"}).json()
        assert saved["n_saved"] == len(parked.parked[0].tokens)
        target = next(s for s in server.slots if not s.parked and s is not parked)
        restored = live.post(f"/slots/{target.id}?action=restore", {"filename": "p.slot"}).json()
        assert restored["n_restored"] == saved["n_saved"]
        history[0].append({"role": "user", "content": message(len(history[0]), 4)})
        r = live.post("/v1/chat/completions", {"model": "m", "messages": history[0], "max_tokens": 16,
                                               "temperature": 0}).json()  # fmt: skip
        assert r["kvlite"]["slot"] in (target.id, parked.id) and r["kvlite"]["reused_tokens"] > 0
        assert r["choices"][0]["message"]["content"] == expected[0][1]
        assert server.pool.ctx.cells_in_use() <= 512
    finally:
        live.stop()


def converse_at_once(live: Live, turns: int, n: int) -> dict[int, list[str]]:
    """n clients at once, each holding its own conversation of `turns` turns (converse, one thread a
    client); the replies by conversation."""
    with ThreadPoolExecutor(n) as clients:
        runs = [clients.submit(converse, live, [i] * turns) for i in range(n)]
        return {i: run.result()[i] for i, run in enumerate(runs)}


def complete(live: Live, i: int) -> str:
    r = live.post("/v1/completions", {"model": "m", "prompt": message(i, 30), "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_conversations_share_decode_steps_and_answer_as_each_alone(chat_model):
    """Four clients at once on a pool that holds them all, and two completions beside them: the
    turns run together, one worker a slot, and their tokens share decode steps (continuous
    batching). Every reply is the reply the conversation (or prompt) gets alone in a server of
    per-slot contexts, and the pool stays llama.cpp's; a completion leaves no cell behind."""
    settings = SAME
    separate = Live(Server(ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings), model=chat_model))
    try:
        expected = {i: converse(separate, [i] * 2)[i] for i in range(4)}
        completions = [complete(separate, i) for i in (5, 6)]
    finally:
        separate.stop()
    live = Live(Server(ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings, kv_cells=1536),
                       model=chat_model))  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as clients:
            side = [clients.submit(complete, live, i) for i in (5, 6)]
            assert converse_at_once(live, 2, 4) == expected
            assert [c.result() for c in side] == completions
        server = live.server
        batcher = server.pool.ctx.batcher
        assert batcher.jobs >= 1.5 * batcher.steps, f"{batcher.jobs} decodes in {batcher.steps} steps"
        # a conversation idle between its turns may be parked by another's turn, and restored by its own
        assert server.metrics.restored <= server.metrics.parked and not server.reserved
        for slot in server.slots:
            cache = slot.conversation.runner.cache
            assert not slot.busy and np.array_equal(cache.llama_positions(LIVE), cache.positions())
        assert server.pool.ctx.cells_in_use() == sum(s.resident for s in server.slots)
    finally:
        live.stop()


def test_turns_that_do_not_fit_together_wait_for_room(chat_model):
    """Four clients at once on a pool of 512 cells, where a second turn reserves about 190 (what it
    holds, its message and 16 tokens of reply): the four do not fit together, so turns wait for
    running ones' cells, and idle conversations are parked; no request fails or overfills the pool."""
    settings = RunSettings(n_ctx=384)
    cfg = ServeConfig(api_key=KEY, slots=4, n_predict=16, settings=settings, kv_cells=512)
    live = Live(Server(cfg, model=chat_model))
    try:
        replies = converse_at_once(live, 2, 4)
        assert all(len(r) == 2 for r in replies.values())
        server = live.server
        assert server.metrics.waited >= 1 and server.metrics.parked >= 1 and not server.reserved
        assert server.pool.ctx.cells_in_use() == sum(s.resident for s in server.slots) <= 512
        metrics = httpx.get(live.url + "/metrics", headers=AUTH).text
        assert f"kvlite_turns_waited_total {server.metrics.waited}" in metrics
        assert f"kvlite_decode_steps_total {server.pool.ctx.batcher.steps}" in metrics
    finally:
        live.stop()
