"""Multi-turn cells: a generated conversation (a document turn, then questions turn by turn) replayed
under one policy and one chat eviction mode, as `kvlite chat` runs it (lazy mode under the cap
that lazy_cap sets), scored per question turn. The document turn but its last few tokens is read once
per conversation (read_document); every cell starts from that snapshot and reads the rest itself,
so its policy observes those tokens' queries, as SampleRun's cells do."""

from __future__ import annotations

import time

import numpy as np

from ..api import Conversation, Session
from ..cache import Snapshot
from ..engine import Model, SamplingParams, kvstate
from ..limits import DEFAULT_CHUNK
from ..policies import Policy
from ..policies.observe import Observation
from ..settings import RunSettings
from . import metrics
from .evaluate import ScoreMemo, read_prefix
from .tasks import Sample


def conversation_cap(model: Model, sample: Sample, policy: Policy) -> int:
    """The context a cell allocates: room for the whole conversation (eager mode's budget is the
    policy's to keep; lazy mode's cap is set lower once the document is read, see lazy_cap)."""
    extra = policy.lookahead_cells() + 64
    doc = len(model.tokenize_chat([{"role": "user", "content": sample.turns[0][0]}]))
    turn = lambda m: len(model.tokenize_chat([{"role": "user", "content": m}])) + 8  # noqa: E731 - template included
    return doc + sum(turn(m) for m, _ in sample.turns[1:]) + len(sample.turns) * (sample.max_new_tokens + 8) + extra


def lazy_cap(conv: Conversation, question: str, n_predict: int) -> int:
    """Lazy mode's cap in a grid: the document turn as read, then room for the first question but
    not for its reply, so that question forces the eviction and its own queries choose what stays.
    A larger cap would hold the whole conversation (lazy would be the full cache, at its memory);
    a cap below the document would make it eager. The peak is then the document plus one question,
    about what eager mode needs while it reads the document."""
    extra = conv.runner.policy.lookahead_cells()
    return conv.runner.cache.n_resident + conv.pending_tokens(question) + extra + n_predict // 2


def read_document(model: Model, sample: Sample, tail: int, n_threads: int | None = None,
                  kv_type: str = "f16") -> Snapshot | None:  # fmt: skip
    """The document turn read once but its last `tail` tokens (at least one is left to feed)."""
    tokens = model.tokenize_chat([{"role": "user", "content": sample.turns[0][0]}])
    head = tokens[: max(0, len(tokens) - max(1, tail))]
    return read_prefix(model, head, len(tokens) + 8, n_threads, kv_type)


class FirstEviction(ScoreMemo):
    """Shares the scores of a conversation's first eviction between cells of other budgets: until a
    cell first evicts, its cache holds what every cell's holds (the same turns, greedy replies), so a
    policy whose scores do not depend on the budget scores it the same. Later evictions differ. A
    cell that reuses the scores is charged what computing them cost (the cells its workspace held,
    its workspace forward passes), so its record reads as a fresh run's."""

    def scores(self, obs: Observation) -> np.ndarray:
        if obs.cache.evicted:
            return self.policy.scores(obs)
        scores = super().scores(obs)
        cost = self.memo.setdefault(self.key + " cost", (obs.cache.max_cells, obs.workspace_forward_passes))
        obs.cache.max_cells = max(obs.cache.max_cells, cost[0])
        obs.workspace_forward_passes = cost[1]
        return scores


def run_conversation(
    model: Model,
    sample: Sample,
    policy: Policy,
    evict: str = "eager",
    n_threads: int | None = None,
    document: Snapshot | None = None,
    memo: tuple[dict, str] | None = None,
    kv_type: str = "f16",
    recall: int = 0,
    recall_lookahead: int | None = None,
) -> dict:
    """document: read_document's snapshot (None: the cell reads the document itself; a chunked
    policy, which evicts as it reads, always does). memo: a dict shared by the cells of one
    conversation and this cell's key in it (its policy and mode, not its budget): the first
    eviction's scores are computed once (FirstEviction). recall_lookahead: whether recall scores
    with an eager eviction's lookahead queries too (None: Runner's default)."""
    if memo is not None and not policy.scores_depend_on_budget() and not policy.continuous:
        store, name = memo
        policy = FirstEviction(policy, store, f"{name} {policy.scoring_key()}")  # as SampleRun.cell keys it
    n_ctx = conversation_cap(model, sample, policy)
    settings = RunSettings(n_ctx=n_ctx, chunk=DEFAULT_CHUNK, sampling=SamplingParams(temp=0.0), n_threads=n_threads,
                           type_k=kv_type, type_v=kv_type)  # fmt: skip
    conv = Session(model, policy, settings).conversation(evict=evict, recall=recall)
    if recall_lookahead is not None:
        conv.runner.recall_lookahead = bool(recall_lookahead)
    if document is not None and not policy.continuous:
        conv.start_from(document)
    outputs, scores, status, decode_cells = [], [], [], 0
    t0 = time.perf_counter()
    try:
        for i, (message, answers) in enumerate(sample.turns):
            if evict == "lazy" and i == 1:
                conv.cap = lazy_cap(conv, message, sample.max_new_tokens)
            reply, stopped = conv.turn(message, sample.max_new_tokens, None, lambda: False, progress=False)
            outputs.append(reply)
            status.append(conv.last)
            decode_cells = max(decode_cells, conv.decode_cells)
            if answers:
                scores.append(metrics.score(sample.metric, reply, answers, None))
        cache, t = conv.runner.cache, conv.runner.timings
        recalled = {"recall": recall, "recall_lookahead": conv.runner.recall_lookahead,
                    "stored_cells": len(cache.stored), "store_bytes": kvstate.nbytes(cache.store),
                    "recall_s": t.recall_s} if recall else {}  # fmt: skip
        return {
            "score": sum(scores) / len(scores),
            "turn_scores": scores,
            "outputs": outputs,
            "turns": status,
            "evict": evict,
            "cap": conv.cap,
            "max_cells": cache.max_cells,
            "decode_cells": decode_cells,  # the most resident when a reply began: what decode attends
            "evicted": cache.evicted,
            **recalled,
            "workspace_forward_passes": conv.runner.workspace_forward_passes,
            "prefill_tokens": t.prefill_tokens,  # read by this cell (a shared document's are not)
            "scores_reused": bool(getattr(policy, "reused", False)),
            "time": {
                "cell_s": time.perf_counter() - t0,
                "prefill_s": t.prefill_s - t.evict_s,
                "decode_s": t.decode_s,
                "policy_s": t.evict_s,
            },  # fmt: skip
        }
    finally:
        conv.runner.close()
