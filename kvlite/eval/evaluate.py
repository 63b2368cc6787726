"""Running one sample under many (policy, budget) cells.

The prompt is read once with the full cache (all but its last `tail` tokens) and snapshotted; each
cell restores the snapshot into its own runner, feeds the tail (so the policy captures the queries
it observes, exactly as in `kvlite generate`), evicts, generates greedily, and is then teacher-forced
on the full cache's continuation to measure the fidelity of its next-token distributions.
Prefill-end eviction sees the same prompt whichever way it was read, so only the speed changes;
chunked-mode cells read the whole prompt themselves."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
import zipfile

import numpy as np

from ..cache import KVCache, Snapshot
from ..engine import Capture, Context, Model, SamplingParams
from ..limits import DEFAULT_CHUNK
from ..policies import FullKV, Policy
from ..policies.lookahead import EchoKV
from ..policies.observe import Observation
from ..runner import Runner
from ..settings import RunSettings
from . import longbench, metrics
from .tasks import Sample

BASE_MODEL_CUE = "\nAnswer:"  # what follows a chat task's prompt for a model without a chat template


@dataclasses.dataclass
class Prompt:
    """A sample tokenized for one model, with its evidence as token positions."""

    sample: Sample
    tokens: list[int]
    evidence: list[int]
    max_new_tokens: int
    # Tokens from the closing question's start to the prompt's end (the chat template's closing
    # markers included): what window=question protects. None when the question is not known.
    question_tokens: int | None = None


def tokenize(model: Model, sample: Sample, max_new_tokens: int | None = None, max_length: int = 0) -> Prompt:
    """max_length: a longer prompt keeps its first and last max_length/2 tokens, as LongBench's pred.py
    does (0: the model's training context less the generation and a lookahead's room)."""
    max_new = max_new_tokens or sample.max_new_tokens
    if not max_length and model.info.n_ctx_train:
        max_length = model.info.n_ctx_train - max_new - 64

    def encode(text: str) -> list[int]:
        return model.tokenize(text, add_special=True, parse_special=sample.chat)

    if sample.chat and model.chat_template is not None:
        text = model.apply_chat_template([{"role": "user", "content": sample.prompt}]) + (sample.cue or "")
        offset = text.index(sample.prompt)
    elif sample.chat:  # a base model (no template): a plain completion, cued as lm-eval-harness cues one
        text, offset = sample.prompt + (BASE_MODEL_CUE if sample.cue is None else sample.cue), 0
    else:
        text, offset = sample.prompt + (sample.cue or ""), 0
    tokens = encode(text)
    evidence: list[int] = []
    for a, b in sample.evidence:  # token positions of a character span: the lengths of its prefixes
        evidence.extend(range(len(encode(text[: offset + a])), len(encode(text[: offset + b]))))
    question = len(tokens) - len(encode(text[: offset + sample.question[0]])) if sample.question else None
    if max_length and len(tokens) > max_length:
        half = max_length // 2
        cut = len(tokens) - 2 * half
        # evidence in the dropped middle is not in the prompt; what follows it moves up by the cut
        evidence = [p for p in evidence if p < half] + [p - cut for p in evidence if p >= half + cut]
        tokens = tokens[:half] + tokens[-half:]
        question = question if question is not None and question <= half else None
    return Prompt(sample, tokens, sorted(set(evidence)), max_new, question)


class ScoreMemo:
    """A policy whose scores of one prompt are computed once and reused by cells of other budgets
    (only for policies whose scores do not depend on the budget: the cut then moves, nothing else).
    Everything but `scores` is the wrapped policy's."""

    def __init__(self, policy: Policy, memo: dict, key: str):
        self.policy, self.memo, self.key = policy, memo, key
        self.reused = False

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def scores(self, obs: Observation) -> np.ndarray:
        hit = self.memo.get(self.key)
        if hit is not None and len(hit[0]) == len(obs.positions):
            obs.workspace_views, obs.lookahead_queries = list(hit[1]), list(hit[2])
            self.reused = True
            return hit[0]
        scores = self.policy.scores(obs)
        self.memo[self.key] = (scores, list(obs.workspace_views), list(obs.lookahead_queries))
        return scores


@dataclasses.dataclass
class Reference:
    """What the full cache did: its greedy continuation and the next-token logits along it."""

    tokens: list[int]
    logits: np.ndarray  # [len(tokens) - 1, n_vocab]: after each continuation token but the last

    def save(self, path: pathlib.Path) -> None:
        """Whole or not at all: a kill mid-write leaves no file for a resume to half-read, and a
        failed write (a full disk) leaves nothing."""
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part.npz")
        try:
            np.savez(part, tokens=np.asarray(self.tokens, dtype=np.int64), logits=self.logits)
            os.replace(part, path)
        except BaseException:
            part.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: pathlib.Path) -> Reference | None:
        """A saved reference, or None where there is none that reads whole."""
        try:
            with np.load(path) as z:
                return cls([int(t) for t in z["tokens"]], z["logits"])
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            return None


def read_prefix(model: Model, tokens: list[int], n_ctx: int, n_threads: int | None = None,
                kv_type: str = "f16") -> Snapshot | None:  # fmt: skip
    """A prompt's first tokens read once, as a snapshot every cell restores and then feeds the rest
    itself (the tokens whose queries its policy observes). Hidden states are kept for counter-
    causal fast. None for no tokens. kv_type: the cache type of K and V (a cell's must match)."""
    if not tokens:
        return None
    hidden_layer = model.info.n_layer - 2
    capture = Capture(model.info)
    capture.request("hidden", [hidden_layer])
    ctx = Context(
        model, n_ctx, n_batch=DEFAULT_CHUNK, n_threads=n_threads, type_k=kv_type, type_v=kv_type, capture=capture
    )
    try:
        cache = KVCache(ctx, hidden_layer=hidden_layer)
        for start in range(0, len(tokens), DEFAULT_CHUNK):
            cache.append(tokens[start : start + DEFAULT_CHUNK], logits="none")
        return cache.snapshot()
    finally:
        ctx.close()
        capture.close()


class SampleRun:
    """One prompt read once; `cell(policy)` replays it under a policy and returns a record."""

    def __init__(self, model: Model, prompt: Prompt, tail: int, n_threads: int | None = None, extra_ctx: int = 0,
                 kv_type: str = "f16"):  # fmt: skip
        self.model, self.prompt, self.n_threads, self.kv_type = model, prompt, n_threads, kv_type
        n = len(prompt.tokens)
        self.tail = max(1, min(tail, n - 1)) if n > 1 else 1
        self.n_ctx = n + prompt.max_new_tokens + extra_ctx + 8
        self.reference: Reference | None = None
        self.scores: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {}  # by spec and scoring key (ScoreMemo)
        self.prefix_s: float | None = None  # None until the prefix is read
        self._snapshot: Snapshot | None = None

    def prefix(self) -> Snapshot | None:
        """The prompt but its tail, read on first use: chunked cells read the whole prompt
        themselves, so a resumed sample left with those alone (its reference saved) never reads it."""
        if self.prefix_s is None:
            t0 = time.perf_counter()
            n = len(self.prompt.tokens)
            self._snapshot = read_prefix(self.model, self.prompt.tokens[: n - self.tail], self.n_ctx, self.n_threads,
                                         self.kv_type)  # fmt: skip
            self.prefix_s = time.perf_counter() - t0
        return self._snapshot

    def runner(self, policy: Policy, chunk: int = DEFAULT_CHUNK) -> Runner:
        settings = RunSettings(n_ctx=self.n_ctx, chunk=chunk, sampling=SamplingParams(temp=0.0),
                               n_threads=self.n_threads, type_k=self.kv_type, type_v=self.kv_type)  # fmt: skip
        return Runner(self.model, policy, settings)

    def _read_prompt(self, runner: Runner) -> None:
        tokens = self.prompt.tokens
        snapshot = None if runner.policy.continuous else self.prefix()
        if snapshot is None:
            runner.feed(tokens)
        else:
            runner.restore(snapshot)
            runner.feed(tokens[-self.tail :])

    def cell(
        self, policy: Policy, reuse: str | None = None, chunk: int = DEFAULT_CHUNK, evolution: bool = False
    ) -> dict:
        """Run one policy (FullKV first: it makes the reference) and score it. reuse: a name under
        which the policy's scores are kept and reused by later cells of the same name, when the
        scores do not depend on the budget (the eviction is then the same as a fresh run's).
        chunk: the prefill chunk, and chunked mode's refresh interval h. evolution: record the
        positions kept at every eviction (chunked mode's cache evolution)."""
        prompt, sample = self.prompt, self.prompt.sample
        n = len(prompt.tokens)
        t0 = time.perf_counter()
        reusable = reuse is not None and not policy.scores_depend_on_budget() and not policy.continuous
        # keyed by what the scores depend on too: a default worked out from the budget (EchoKV's
        # smoothing) makes two budgets of one spec score differently
        memo = ScoreMemo(policy, self.scores, f"{reuse} {policy.scoring_key()}") if reusable else None
        runner = self.runner(memo or policy, chunk)
        if evolution and policy.continuous:
            runner.history = []
        try:
            self._read_prompt(runner)
            last = runner.last_eviction
            views = [v[v < n] for v in (last.workspace_views if last else [])]
            out, stopped = runner.generate(prompt.max_new_tokens)
            kept = runner.cache_report(n)["kept_positions"]
            t1 = time.perf_counter()
            if self.reference is None and isinstance(policy, FullKV):
                self.reference = Reference(out, self._teacher_forced(runner, out))
                logits = self.reference.logits
            elif self.reference is not None:
                logits = self._teacher_forced(runner, self.reference.tokens)
            ref = self.reference
            tf_s = time.perf_counter() - t1
        finally:
            runner.close()
        text = self.model.detokenize(out)
        pred = longbench.postprocess(sample, text)
        record = {
            "output": text,
            "score": metrics.score(sample.metric, pred, sample.answers, sample.all_classes),
            "stopped": stopped,
            "prompt_tokens": n,
            "generated": out,
            "kept": kept,
            "question_tokens": prompt.question_tokens,  # where kept cells fell (the grid adds the evidence)
            "evidence_kept": metrics.retention(kept, prompt.evidence) if policy.budget else None,
            "workspace_evidence": [metrics.retention(v, prompt.evidence) for v in views],
            "workspace_sizes": [len(v) for v in views],
            "scores_reused": bool(memo and memo.reused),
        }
        if runner.history is not None:
            record["evolution"] = [[int(p) for p in kept] for kept in runner.history]
        if ref is not None:
            record["exact_match"] = float(out == ref.tokens)
            record["token_agreement"] = metrics.token_agreement(ref.tokens, out)
            if len(ref.logits):
                record["kl"] = float(metrics.kl_divergence(ref.logits, logits).mean())
                record["top1"] = metrics.top1_agreement(ref.logits, logits)
        t = runner.timings
        record["time"] = {
            "cell_s": time.perf_counter() - t0,
            "prefill_s": t.prefill_s - t.evict_s,
            "decode_s": t.decode_s,
            "policy_s": t.evict_s,
            "teacher_forcing_s": tf_s,
        }
        return record

    def _teacher_forced(self, runner: Runner, continuation: list[int]) -> np.ndarray:
        """Next-token logits after each continuation token but the last, fed onto the cache the
        policy left (the first one is the prompt's own, the same under every prefill-end policy)."""
        n = len(self.prompt.tokens)
        runner.cache.truncate(n)
        feed = continuation[:-1]
        if not feed:
            return np.zeros((0, self.model.n_vocab), dtype=np.float32)
        rows = []
        for start in range(0, len(feed), runner.chunk):  # a batch holds at most the runner's chunk (h)
            piece = feed[start : start + runner.chunk]
            runner.cache.append(piece, logits="all")
            rows += [runner.ctx.logits(i) for i in range(len(piece))]
        return np.stack(rows)

    # -- EchoKV Table 1 -------------------------------------------------------------------------
    def overlap(self, budget: int, lookahead: int = 8, steps: int = 8, **echokv) -> dict:
        """KV overlap (EchoKV Eq. 1) of the top-`budget` sets per layer and KV group chosen by each
        lookahead step's query with those of the true step-k query (greedy on the full cache), for
        T steps on a frozen W1 and for the refreshed schedule (W2 built at T/2)."""
        policy = EchoKV(budget=None, lookahead=lookahead, **echokv)
        policy.validate()
        runner = self.runner(policy)
        try:
            self._read_prompt(runner)
            obs = runner.observation()

            def frozen(view: np.ndarray) -> np.ndarray:
                look = obs.lookahead(view)
                try:
                    return look.step(lookahead)
                finally:
                    look.close()

            true = frozen(obs.positions)  # the whole prompt in view: the full cache
            w1_frozen = frozen(policy.bootstrap(obs))
            refreshed = policy.lookahead_queries(obs)  # EchoKV's own schedule

            def sets(q: np.ndarray, k: int) -> np.ndarray:
                return obs.pooled(np.ascontiguousarray(q[:, :, k : k + 1]), policy.pool_kernel)

            ks = range(min(steps, lookahead))
            truth = [sets(true, k) for k in ks]
            return {
                "frozen": [metrics.topk_overlap(sets(w1_frozen, k), truth[k], budget) for k in ks],
                "refreshed": [metrics.topk_overlap(sets(refreshed, k), truth[k], budget) for k in ks],
                "workspace": policy.workspace,
                "pool_kernel": policy.pool_kernel,
                "lookahead": lookahead,
                "budget": budget,
            }
        finally:
            runner.close()
