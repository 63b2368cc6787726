"""KVzip (Kim et al., 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction";
kvpress's KVzipPress): keep what the model needs to repeat the context. The resident cells are
teacher-forced back, chunk by chunk, after a prompt asking for them to be repeated, on a
workspace view of the whole cache; a cell's score is the largest attention any query of its
chunk's pass pays it. No question is needed, so a document turn can be compressed before the
questions about it arrive (what KVzip's own code kept where the prompt-window methods lost
everything: docs/design.md, "The peers").

How the port reads the reference code (snu-mllab/KVzip attention/score.py, kvpress
kvzip_press.py): the prompts are theirs; each pass's softmax runs over the first `sinks` cells,
its chunk's cells and the pass's own tokens (causally), as theirs; the score is the maximum over
the pass's queries and the query heads of a KV group, as theirs. KVzip then keeps (layer, head,
token) triples above one global threshold; llama.cpp frees whole tokens, so kvlite needs one score
per token. The faithful reading (`--pair-vote votes`: how many of a token's triples clear KVzip's
threshold) keeps evidence at chance on SmolLM2, because a copying head pays every token nearly
all its attention as it is repeated. kvlite's default (its own, chosen on the tune split:
results-runs/kvzip-tune-1024, docs/policies.md) leaves out the heads that pay every token
(`selective`) and smooths each head's scores with SnapKV's max-pool of 7, as kvlite's SnapKV does."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from ..errors import KvliteError
from ..native import max_smooth, native
from .attention import pool_kernel_param
from .base import Policy, param
from .observe import Observation

FIRST = "Repeat the previous context exactly."
LATER = "Repeat the part of the previous context exactly, starting with"
PAIR_VOTES = ("votes", "max", "mean", "selective")
POSTFIX = 8  # tokens of the previous chunk quoted in a later chunk's prompt (KVzip's prev_postfix_size)
PROMPT_ROOM = 160  # cells a repeat prompt may take beside its chunk (27 on SmolLM2; a byte-level vocabulary needs ~125)


def repeat_prompt(model, previous: list[int] | None) -> list[int]:
    """The repeat instruction as a user turn of the model's template (plain text without one),
    ending where the assistant's reply, the teacher-forced context, begins. A later pass quotes the
    previous pass's last tokens as they are (KVzip decodes and re-encodes them: the same text)."""
    text = FIRST if previous is None else LATER
    quoted = [] if previous is None else list(previous)
    if model.chat_template is None:
        head, tail = f"\n\n{text} ", "\n\n"
    else:
        pieces = model.chat_segments([{"role": "user", "content": text}], add_assistant=True)
        at = next(i for i, (_, literal) in enumerate(pieces) if literal)
        head = "".join(t for t, _ in pieces[: at + 1]) + (" " if quoted else "")
        tail = "".join(t for t, _ in pieces[at + 1 :])
    out = model.tokenize(head, add_special=False, parse_special=model.chat_template is not None)
    out += quoted + model.tokenize(tail, add_special=False, parse_special=True)
    if len(out) > PROMPT_ROOM:
        raise KvliteError(f"kvzip's repeat prompt takes {len(out)} tokens, more than the {PROMPT_ROOM} set aside")
    return out


@dataclasses.dataclass
class KVzip(Policy):
    """repeat_chunk: cells reconstructed per pass (KVzip uses 2000; smaller passes bound memory:
    the pass's queries and keys, and its [queries x keys] scores per layer)."""

    name = "kvzip"
    reads = "the attention of repeat-the-context passes over the cached keys of {layers}"
    captures: ClassVar[tuple[str, ...]] = ("q", "k")  # of the reconstruction passes
    repeat_chunk: int = param(512, "--repeat-chunk", "kvzip: cells teacher-forced back per reconstruction pass",
                              alias="C", minimum=16)  # fmt: skip
    pair_vote: str = param("selective", "--pair-vote", "kvzip: (layer, head) scores to one per token: votes "
                           "(pairs above KVzip's global threshold), max, mean, or selective (kvlite's own: the max "
                           "over the pairs that do not pay every token)", type=str, choices=PAIR_VOTES)  # fmt: skip
    pool_kernel: int = pool_kernel_param(7)

    def lookahead_cells(self) -> int:
        return self.repeat_chunk + PROMPT_ROOM

    def scores_depend_on_budget(self) -> bool:
        return self.pair_vote == "votes"  # the global threshold keeps budget/n of the pairs

    def scores(self, obs: Observation) -> np.ndarray:
        return self.reconstruction_scores(obs)

    def reconstruction_scores(self, obs: Observation) -> np.ndarray:
        return to_tokens(self.pair_scores(obs), self.pair_vote, self.budget)

    def pair_scores(self, obs: Observation) -> np.ndarray:
        """KVzip's score of every (layer, KV head, resident cell): [L, Hkv, n] (the sinks: inf)."""
        pos = obs.positions
        n = len(pos)
        tokens = obs.cache.tokens_at(pos)
        keys = obs.keys  # a layer at a time: [Hkv, n, D]
        sink = min(self.sinks, n)
        out = np.full(
            (len(keys.layers), keys.n_head_kv, n), np.inf
        )  # the sinks are in every pass's softmax, always kept
        for c0 in range(sink, n, self.repeat_chunk):
            c1 = min(c0 + self.repeat_chunk, n)
            previous = None if c0 == sink else tokens[max(sink, c0 - POSTFIX) : c0]
            look = obs.lookahead(pos)  # the workspace views every resident cell
            try:
                q, k = look.reconstruct(repeat_prompt(obs.model, previous) + tokens[c0:c1])
            finally:
                look.close()
            cells = np.r_[0:sink, c0:c1]  # what the pass's softmax sees of the cache: its sinks and chunk
            for i, il in enumerate(keys.layers):
                cached = keys.layer(il, cells)
                ks = np.concatenate([cached, k[i].astype(cached.dtype)], axis=1)
                s = native().attn_pool(q[i][None], ks[None], obs.info.kq_scale, reduce="max", causal_tail=q[i].shape[1])
                out[i, :, c0:c1] = s[0, :, sink : sink + c1 - c0]  # s: [1, Hkv, sink + chunk + pass]
            del q, k  # else they live on through the next pass's capture: twice the memory
        return max_pool(out, self.pool_kernel)


def max_pool(pairs: np.ndarray, kernel: int) -> np.ndarray:
    """SnapKV's smoothing on each (layer, head) row of pair scores: a cell takes the largest score
    within kernel // 2 cells of it, over the scored cells only (the sinks stay inf and lend nothing)."""
    if kernel <= 1:
        return pairs
    finite = np.isfinite(pairs[0, 0])
    out = pairs.copy()
    out[:, :, finite] = max_smooth(pairs[:, :, finite], kernel)
    return out


def to_tokens(pairs: np.ndarray, how: str, budget: int | None) -> np.ndarray:
    """One score per token from [L, Hkv, n] pair scores (the sinks: inf, kept).
    votes: KVzip keeps the (layer, head, token) triples above one global threshold, set so that the
    share of them that survives is the share of scored tokens the budget keeps; a token scores the
    number of its triples that survive (ties: the mean). max / mean: over layers and KV heads. On
    SmolLM2 every token has a copying head that pays it nearly all its attention, so the maximum is
    nearly flat (docs/policies.md, "Token-level KVzip"). selective (kvlite's own): the maximum over
    the pairs whose median score is at most the median of the pairs' medians; a copying head pays
    nearly every token as it is repeated, so its high median says it cannot tell tokens apart, and
    it is left out."""
    n = pairs.shape[2]
    finite = np.isfinite(pairs[0, 0])
    out = np.full(n, np.inf)
    p = pairs[:, :, finite]
    if p.size == 0:
        return out
    if how == "max":
        out[finite] = p.max(axis=(0, 1))
    elif how == "mean":
        out[finite] = p.mean(axis=(0, 1))
    elif how == "selective":
        flat = p.reshape(-1, p.shape[2])
        medians = np.median(flat, axis=1)
        out[finite] = flat[medians <= np.median(medians)].max(axis=0)
    else:
        scored = int(finite.sum())
        keep = min(1.0, max(0.0, ((budget or n) - (n - scored)) / scored))  # the share of scored tokens kept
        threshold = np.quantile(p, 1 - keep)
        out[finite] = (p > threshold).sum(axis=(0, 1)) + p.mean(axis=(0, 1)) / (p.shape[0] * p.shape[1] + 1)
    return out
