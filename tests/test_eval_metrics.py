"""Every evaluation metric against values computed by hand (in the comments)."""

import math

import numpy as np
import pytest

from kvlite.errors import KvliteError
from kvlite.eval import metrics as M


def test_qa_f1_normalizes_and_scores_bag_of_words():
    # "The cat sat!" -> "cat sat"; "a cat sat down" -> "cat sat down": 2 shared, p = 1, r = 2/3, F1 = 0.8
    assert M.qa_f1("The cat sat!", "a cat sat down") == pytest.approx(0.8)
    assert M.qa_f1("dog", "cat") == 0.0
    assert M.normalize_answer("  The  Quick, brown fox. ") == "quick brown fox"


def test_rouge_l_f():
    # LCS of "cat sat on mat" and "cat is on mat" is "cat on mat": p = r = 3/4, F = 0.75
    assert M.rouge("cat sat on mat", "cat is on mat") == pytest.approx(0.75, abs=1e-6)
    assert M.rouge("", "cat") == 0.0  # LongBench scores an empty prediction 0


def test_classification_counts_named_classes():
    classes = ["Location", "Description", "Abbreviation"]
    assert M.classification("Description", "Description", all_classes=classes) == 1.0
    assert M.classification("Location or Description", "Description", all_classes=classes) == 0.5  # 1 / 2 named
    assert M.classification("Abbreviation", "Description", all_classes=classes) == 0.0
    with pytest.raises(KvliteError):
        M.classification("x", "y", all_classes=None)


def test_retrieval_and_count_share_of_numbers():
    assert M.retrieval("Paragraph 3", "Paragraph 3") == 1.0
    assert M.retrieval("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5  # 1 of 2 numbers
    assert M.retrieval("no idea", "Paragraph 3") == 0.0
    assert M.count("There are 12 paragraphs", "12") == 1.0
    assert M.count("12 or 13", "12") == 0.5
    with pytest.raises(KvliteError):
        M.retrieval("1", "3")


def test_code_sim_first_plain_line():
    assert M.code_sim("# a comment\nx = 1\ny = 2", "x = 1") == 1.0
    # "x = 2" vs "x = 1": 4 of 5 characters match each way, ratio 2 * 4 / 10 = 0.8
    assert M.code_sim("x = 2", "x = 1") == 0.8


def test_score_max_over_answers_and_contains_all():
    assert M.score("qa_f1", "Paris", ["London", "paris"]) == 1.0
    assert M.score("contains_all", "AB and CD", ["AB", "CD"]) == 1.0
    assert M.score("contains_all", "only AB", ["AB", "CD"]) == 0.0  # every variable must be named
    with pytest.raises(KvliteError, match="unknown metric"):
        M.score("bleu", "x", ["x"])


def test_token_agreement():
    assert M.token_agreement([1, 2, 3, 4], [1, 2, 9]) == 0.5  # 2 of 4 reference positions
    assert M.token_agreement([], []) == 1.0


def test_kl_and_top1():
    # p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 0.1438410
    ref = np.array([[0.0, 0.0]])
    kl = M.kl_divergence(ref, np.array([[math.log(3), 0.0]]))
    assert kl[0] == pytest.approx(0.5 * math.log(2 / 3) + 0.5 * math.log(2), abs=1e-12)
    assert M.kl_divergence(ref, ref)[0] == pytest.approx(0.0, abs=1e-15)
    assert M.top1_agreement(np.array([[1.0, 0], [0, 1]]), np.array([[2.0, 0], [3, 1]])) == 0.5


def test_retention_and_topk_overlap():
    assert M.retention([1, 2, 3], [2, 3, 4, 5]) == 0.5
    assert M.retention([1], []) is None
    # row 1: top-2 of a = {0, 1}, of b = {2, 1}: 1/2; row 2 identical: 1 -> mean 0.75
    a = np.array([[3.0, 2, 1, 0], [0, 1, 2, 3]])
    b = np.array([[0.0, 2, 3, 1], [0, 1, 2, 3]])
    assert M.topk_overlap(a, b, 2) == pytest.approx(0.75)
