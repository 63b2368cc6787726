"""Multi-turn cells: a generated conversation (a document turn, then questions turn by turn) replayed
under one policy and one chat eviction mode, exactly as `kvlite chat` runs it, scored per question
turn. Every cell reads the document itself: a conversation's cache depends on the mode from the
first turn on, so there is no shared prefix to replay."""

from __future__ import annotations

import time

from ..api import Session
from ..engine import Model, SamplingParams
from ..policies import Policy
from ..runner import DEFAULT_CHUNK, RunSettings
from . import metrics
from .tasks import Sample

LAZY_ROOM = 256  # lazy mode's cap in a grid: the document turn plus this many cells


def conversation_cap(model: Model, sample: Sample, policy: Policy, evict: str) -> int:
    """The cache cap a cell runs under. Eager: room for the whole conversation (the budget is the
    policy's to keep). Lazy: the document turn plus LAZY_ROOM, so the document survives whole until
    a question needs room, which is the mode's point; a cap below the document would make it eager."""
    extra = policy.lookahead_cells() + 64
    doc = len(model.tokenize_chat([{"role": "user", "content": sample.turns[0][0]}]))
    if evict == "lazy":
        return doc + sample.max_new_tokens + LAZY_ROOM + extra
    turn = lambda m: len(model.tokenize_chat([{"role": "user", "content": m}])) + 8  # noqa: E731 - template included
    return doc + sum(turn(m) for m, _ in sample.turns[1:]) + len(sample.turns) * (sample.max_new_tokens + 8) + extra


def run_conversation(
    model: Model, sample: Sample, policy: Policy, evict: str = "eager", n_threads: int | None = None
) -> dict:
    cap = conversation_cap(model, sample, policy, evict)
    settings = RunSettings(n_ctx=cap, chunk=DEFAULT_CHUNK, sampling=SamplingParams(temp=0.0), n_threads=n_threads)
    conv = Session(model, policy, settings).conversation(evict=evict)
    outputs, scores, status = [], [], []
    t0 = time.perf_counter()
    try:
        for message, answers in sample.turns:
            reply, stopped = conv.turn(message, sample.max_new_tokens, None, lambda: False, progress=False)
            outputs.append(reply)
            status.append(conv.last)
            if answers:
                scores.append(metrics.score(sample.metric, reply, answers, None))
        cache, t = conv.runner.cache, conv.runner.timings
        return {
            "score": sum(scores) / len(scores),
            "turn_scores": scores,
            "outputs": outputs,
            "turns": status,
            "evict": evict,
            "cap": cap,
            "max_cells": cache.max_cells,
            "evicted": cache.evicted,
            "workspace_forward_passes": conv.runner.workspace_forward_passes,
            "time": {
                "cell_s": time.perf_counter() - t0,
                "prefill_s": t.prefill_s - t.evict_s,
                "decode_s": t.decode_s,
                "policy_s": t.evict_s,
            },  # fmt: skip
        }
    finally:
        conv.runner.close()
