"""What a policy may look at when it scores the live cache, and the lookahead mechanics written once.

An Observation is made at an eviction point from explicit parts: the cache, the model's facts,
the queries captured while the last tokens were fed, and (for lookahead) the context and its
capture. Each piece (cached keys, pooled attention, proposals, lookahead queries) is computed when
a policy first asks for it, from what llama.cpp holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..engine import Capture, Context, cachetypes
from ..errors import KvliteError
from ..native import native, release
from ..scoring.aggregate import aggregate
from ..scoring.proposals import proposals, spread
from ..selection import ranked

Queries = np.ndarray | Callable[[int], np.ndarray]  # [L, H, n, D], or layer i's [1, H, n, D] on demand

if TYPE_CHECKING:
    from ..cache import KVCache
    from ..cached_kv import CachedKV, JointKV
    from ..engine import Model


class Observation:
    """cache: the live cache; model: its facts and tokenizer; observed: the queries of the last
    tokens fed, by kind ("q", "q_pre") [L, n, H, D]; ctx and capture: where a lookahead decodes and what it
    captures (None when the policy does not look ahead); question: whether the tokens fed last end
    with a question the reply answers (None: unknown; a chat's document turn is False)."""

    def __init__(
        self,
        cache: KVCache,
        model: Model,
        observed: dict[str, np.ndarray] | None = None,
        ctx: Context | None = None,
        capture: Capture | None = None,
        question: bool | None = None,
    ):
        self.cache, self.model, self.info = cache, model, model.info
        self.question = question
        self.observed = observed or {}
        self.ctx, self.capture = ctx, capture
        self.positions = self.cache.positions()  # resident live positions, ascending: what scores index
        self.workspace_forward_passes = 0
        self.next_logits: np.ndarray | None = None  # the prompt's own, saved before a lookahead overwrites them
        self.workspace_views: list[np.ndarray] = []  # prompt positions each lookahead round viewed (diagnostics)
        self.lookahead_queries: list[np.ndarray] = []  # each lookahead step's queries [L, H, n, D] (recall reads them)
        self.method: str | None = None  # how the policy scored, when it has more than one way (the hybrid)

    # -- what the prefill left ------------------------------------------------------------------
    @functools.cached_property
    def keys(self) -> CachedKV:
        """Cached post-RoPE keys of the resident cells, from llama.cpp's state, a layer at a time:
        keys.layer(il) is [Hkv, n, D] f16 in the order of `positions`."""
        keys = self.cache.cached_kv()
        assert np.array_equal(keys.positions, self.positions)
        return keys

    def close(self) -> None:
        """Let go of what the observation read (the keys' state file) and the kernels' scratch, which
        would otherwise be held beside the compaction and the decode that follow."""
        if "keys" in self.__dict__:
            self.__dict__.pop("keys").close()
        release()

    def last_queries(self, n: int, kind: str = "q") -> np.ndarray:
        """Post-RoPE ("q") or pre-RoPE ("q_pre") queries of the last n tokens fed: [L, H, n, D], L
        the full layers (ModelInfo.full_layers) in order, as every [L, ...] array here."""
        rows = self.observed.get(kind)
        if rows is None or rows.shape[1] < n:
            raise KvliteError(f"the runner did not capture {kind} of the last {n} tokens")
        return np.ascontiguousarray(rows[:, -n:].transpose(0, 2, 1, 3))

    def pooled(self, queries: Queries, pool_kernel: int = 0) -> np.ndarray:
        """EchoKV Eq. 3 of these queries over every resident cell: [L, Hkv, n], a layer at a time.
        queries: [L, H, n, D], or a function of i giving layer i's [1, H, n, D] (made when scored)."""
        return pooled(queries, self.keys, self.info.kq_scale, pool_kernel)

    def token_scores(self, queries: Queries, aggregation: str, pool_kernel: int, budget: int) -> np.ndarray:
        return aggregate(self.pooled(queries, pool_kernel), aggregation, budget)

    def proposals(self, anchors: int, steps: int, count: int | None = None) -> Callable[[int], np.ndarray]:
        """EchoKV Eq. 2: the last `anchors` pre-RoPE queries rotated to the next `steps` positions
        (count: to `count` of them, spread evenly from the first to the last), made a layer at a
        time as pooled reads them (all layers at once: 27 MB for EchoKV's 16 x 24 on SmolLM2,
        beside an eviction that should cost no more than the cache it saves)."""
        pre = self.last_queries(anchors, "q_pre").transpose(0, 2, 1, 3)  # [L, S, H, D]
        start, layers = self.cache.n_pos, self.info.full_layers
        positions = (start + spread(steps, count)).tolist()
        return lambda i: proposals(self.info, pre[i : i + 1], positions, [layers[i]])

    def top(self, scores: np.ndarray, n: int) -> np.ndarray:
        """The n resident positions with the highest scores (ties: later first), ascending."""
        return np.sort(self.positions[ranked(self.positions, scores)[:n]])

    # -- lookahead on the workspace sequence ------------------------------------------------------
    def lookahead(self, prompt_view: np.ndarray) -> Lookahead:
        return Lookahead(self, prompt_view)


class Lookahead:
    """Greedy decoding on a workspace view of some prompt cells (sequence 1), collecting the post-
    RoPE query of every decoded token. The live sequence is untouched; `close` drops it all."""

    def __init__(self, obs: Observation, prompt_view: np.ndarray):
        if obs.ctx is None or obs.capture is None or not obs.capture.wants("q", obs.info.full_layers[0]):
            raise KvliteError("lookahead needs a context capturing queries")
        self.obs = obs
        self.cache = obs.cache
        self.capture: Capture = obs.capture
        self.ctx: Context = obs.ctx
        last = self.cache.n_pos - 1
        self.cache.workspace.create(sorted(set(np.asarray(prompt_view).tolist()) | {last}))
        obs.workspace_views.append(self.cache.positions(1))
        if obs.next_logits is None:
            obs.next_logits = self.ctx.logits(-1)
        self.next_token = int(np.argmax(obs.next_logits))  # the prefill's own next token
        self.tokens: list[int] = []

    def view(self, prompt_view: np.ndarray) -> None:
        """Swap the prompt part of the workspace; lookahead tokens decoded so far stay."""
        want = set(np.asarray(prompt_view).tolist()) | {self.cache.n_pos - 1}
        viewed = self.cache.positions(1)
        have = set(viewed[viewed < self.cache.n_pos].tolist())
        self.cache.workspace.remove(sorted(have - want))  # first: a copied view's context frees them
        self.cache.workspace.add(sorted(want - have))
        self.obs.workspace_views.append(np.array(sorted(want)))

    def step(self, n: int) -> np.ndarray:
        """Decode n greedy tokens on the workspace; their queries [L, H, n, D]."""
        info = self.obs.info
        self.capture.clear()
        self.capture.enabled = True
        try:
            for _ in range(n):
                self.cache.workspace.decode([self.next_token], logits="last")
                self.obs.workspace_forward_passes += 1
                self.tokens.append(self.next_token)
                self.next_token = int(np.argmax(self.cache.workspace.ctx.logits(-1)))
            q = np.stack([self.capture.take("q", il) for il in info.full_layers])  # [L, n, H, D]
        finally:
            self.capture.enabled = False
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
        self.obs.lookahead_queries.append(q)
        return q

    def reconstruct(self, tokens: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Teacher-force tokens on the workspace after what it views (KVzip's repeat pass). Returns
        their post-RoPE queries and keys per layer ([H, n, D] and [Hkv, n, D]). Taken a layer at a
        time, so the capture's buffer shrinks as the copies grow (no stacked copy of all layers)."""
        info = self.obs.info
        if not self.capture.wants("k", info.full_layers[0]):
            raise KvliteError("reconstruction needs a context capturing keys")
        self.capture.clear()
        self.capture.enabled = True
        try:
            self.cache.workspace.decode(tokens, logits="none")
            self.obs.workspace_forward_passes += -(-len(tokens) // self.cache.workspace.ctx.n_batch)
            q = [_heads_first(self.capture.take("q", il)) for il in info.full_layers]
            k = [_heads_first(self.capture.take("k", il)) for il in info.full_layers]
        finally:
            self.capture.enabled = False
        return q, k

    def close(self) -> None:
        if self.cache.workspace.active:
            self.cache.workspace.drop()


def pooled(queries: Queries, keys: CachedKV | JointKV, scale: float, pool_kernel: int = 0) -> np.ndarray:
    """EchoKV Eq. 3 of queries over every cell of `keys`: [L, Hkv, n], a layer at a time.
    queries: [L, H, n, D], or a function of i giving layer i's [1, H, n, D] (made when scored)."""
    layer = queries if callable(queries) else (lambda i: queries[i : i + 1])
    try:
        return np.concatenate([pooled_layer(layer(i), keys, il, scale, pool_kernel)
                               for i, il in enumerate(keys.layers)])  # fmt: skip
    finally:
        release()  # the kernels' scratch is never held beside what follows a pass (docs/cache.md)


def pooled_layer(q: np.ndarray, keys: CachedKV | JointKV, il: int, scale: float, pool_kernel: int = 0) -> np.ndarray:
    """Eq. 3 of queries q [1, H, n_q, D] over layer il's cached keys, read as llama.cpp stores them:
    a quantized cache's blocks go to the kernel as they are, and the queries are rotated by the
    same Hadamard matrix as its keys ((Hq).(Hk) = q.k), as llama.cpp's own graph does; so no f32
    copy of the layer is made on the host."""
    k_type, k = keys.layer_blocks(il)
    if k.dtype != np.uint8:
        return native().attn_pool(q, k[None], scale, pool_kernel=pool_kernel)
    q = cachetypes.unrotate(np.array(q, dtype=np.float32), keys.rotations[0])  # H is its own inverse
    return native().attn_pool(q, k[None], scale, pool_kernel=pool_kernel, k_type=k_type)


def _heads_first(a: np.ndarray) -> np.ndarray:
    """[n, H, D] -> contiguous [H, n, D]."""
    return np.ascontiguousarray(a.transpose(1, 0, 2))
