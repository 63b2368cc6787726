"""Scores of a prediction against gold answers, and the fidelity of an evicted cache to the full one.

The LongBench metrics reproduce THUDM/LongBench's metrics.py (quirks included, so numbers compare):
qa_f1 (normalized bag-of-words F1), rouge (rouge-l F of the `rouge` package), classification,
retrieval, count and code_sim (fuzzywuzzy's ratio, whose pure-Python path is difflib's)."""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import KvliteError


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's normalization)."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_tokens(prediction: Sequence[str], truth: Sequence[str]) -> float:
    same = sum((Counter(prediction) & Counter(truth)).values())
    if same == 0:
        return 0.0
    p, r = same / len(prediction), same / len(truth)
    return 2 * p * r / (p + r)


def qa_f1(prediction: str, truth: str, **_) -> float:
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(truth).split())


def rouge(prediction: str, truth: str, **_) -> float:
    from rouge import Rouge

    try:
        return float(Rouge().get_scores([prediction], [truth], avg=True)["rouge-l"]["f"])
    except (ValueError, RecursionError):  # LongBench scores an empty hypothesis 0 the same way
        return 0.0


def classification(prediction: str, truth: str, all_classes: Sequence[str] | None = None, **_) -> float:
    """LongBench's: the classes named in the prediction (a class that is a substring of the truth but not
    the truth dropped); 1/len if the truth is among them. (LongBench's fallback to the most similar class
    never runs: it tests `list != 0`; kept, so scores compare.)"""
    if not all_classes:
        raise KvliteError("the classification metric needs all_classes")
    matched = [c for c in all_classes if c in prediction]
    for term in matched:  # removing while iterating skips the next term: LongBench's behaviour, kept
        if term in truth and term != truth:
            matched.remove(term)
    return 1.0 / len(matched) if truth in matched else 0.0


def _number_share(prediction: str, truth_number: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == truth_number for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, truth: str, **_) -> float:
    """Share of the numbers in the prediction that are the gold paragraph's ("Paragraph 12")."""
    found = re.findall(r"Paragraph (\d+)", truth)
    if not found:
        raise KvliteError(f"retrieval answers look like 'Paragraph N', got '{truth}'")
    return _number_share(prediction, found[0])


def count(prediction: str, truth: str, **_) -> float:
    return _number_share(prediction, str(truth))


def code_sim(prediction: str, truth: str, **_) -> float:
    """fuzz.ratio of the first prediction line without ` # or // against the gold line."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n") if not any(m in ln for m in ("`", "#", "//"))), "")
    return round(100 * difflib.SequenceMatcher(None, line, truth).ratio()) / 100


def contains_all(prediction: str, truth: str, **_) -> float:
    """Generated tasks: the answer string appears in the output (scored over all answers by `score`)."""
    return float(truth in prediction)


def string_match(prediction: str, truth: str, **_) -> float:
    """RULER's: the answer appears in the output, case aside (scored over all answers by `score`)."""
    return float(truth.lower() in prediction.lower())


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "rouge": rouge,
    "classification": classification,
    "retrieval": retrieval,
    "count": count,
    "code_sim": code_sim,
    "contains_all": contains_all,
    "contains_share": contains_all,  # per answer; `score` averages them
    "string_match_all": string_match,  # RULER's niah, vt, cwe, fwe: the share of answers found
    "string_match_part": string_match,  # RULER's qa: any answer found
}


def score(metric: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """One sample's score: LongBench's max over gold answers (RULER's string_match_part too); for
    contains_all, 1 only if every answer appears (variable tracking asks for all variables); for
    contains_share and RULER's string_match_all, the share that appears."""
    fn = METRICS.get(metric)
    if fn is None:
        raise KvliteError(f"unknown metric '{metric}': choose from {', '.join(METRICS)}")
    if not answers:
        raise KvliteError("a sample without gold answers cannot be scored")
    if metric == "contains_all":
        return float(all(fn(prediction, a) for a in answers))
    if metric in ("contains_share", "string_match_all"):  # partial credit for each value restated
        return float(np.mean([fn(prediction, a) for a in answers]))
    return max(fn(prediction, a, all_classes=all_classes) for a in answers)


# -- fidelity to the full cache ---------------------------------------------------------------------
def token_agreement(reference: Sequence[int], output: Sequence[int]) -> float:
    """Share of the reference's positions where the output has the same token (a shorter output
    disagrees on the positions it lacks)."""
    if not reference:
        return float(not output)
    return sum(a == b for a, b in zip(reference, output)) / len(reference)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(full || evicted) of next-token distributions, per row, in nats."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def top1_agreement(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    return float((np.argmax(ref_logits, axis=-1) == np.argmax(logits, axis=-1)).mean())


def retention(kept: Sequence[int], evidence: Sequence[int]) -> float | None:
    """Share of evidence positions among the kept ones (None without evidence)."""
    ev = set(int(p) for p in evidence)
    return len(ev & set(int(p) for p in kept)) / len(ev) if ev else None


def topk_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """EchoKV Eq. 1: mean over rows (layer, KV group) of |top-k(a) ∩ top-k(b)| / k; scores [..., n]."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    k = min(k, a2.shape[-1])
    ta = np.argpartition(-a2, k - 1, axis=-1)[:, :k]
    tb = np.argpartition(-b2, k - 1, axis=-1)[:, :k]
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ta.tolist(), tb.tolist())]))
