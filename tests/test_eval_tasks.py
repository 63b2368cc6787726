"""Generated tasks: deterministic, at the length asked, with the evidence where the answer is."""

import pytest

from kvlite.errors import KvliteError
from kvlite.eval import tasks
from kvlite.eval.evaluate import tokenize


def count(text: str) -> int:
    return len(text.encode())  # the tiny models' byte-level vocabulary


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_deterministic_sized_and_evidence_holds_the_answer(task):
    a = tasks.generate(task, 3, 1024, count, seed=7)
    b = tasks.generate(task, 3, 1024, count, seed=7)
    c = tasks.generate(task, 3, 1024, count, seed=8)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in c]
    assert len({s.prompt for s in a}) == 3
    for s in a:
        assert 0.9 * 1024 <= count(s.prompt) <= 1.1 * 1024
        if s.turns is not None:  # multi-turn: every answer was told in an earlier turn, the document first
            assert s.turns[0] == (s.prompt, []) and len(s.turns) >= 4
            for i, (_, answers) in enumerate(s.turns):
                assert all(a in " ".join(m for m, _ in s.turns[:i]) for a in answers)
            continue
        evidence = " ".join(s.prompt[x:y] for x, y in s.evidence)
        assert all(ans in evidence for ans in s.answers)  # the gold answer is stated in the evidence
        assert s.metric in ("contains_all", "contains_share") and s.max_new_tokens > 0


def test_two_hop_evidence_is_two_far_apart_facts():
    (s,) = tasks.generate("twohop", 1, 2048, count, depth=0.2)
    (a0, a1), (b0, b1) = s.evidence
    assert "lives in" in s.prompt[a0:a1] and "secret code" in s.prompt[b0:b1]
    assert b0 - a1 > 0.3 * len(s.prompt)  # dispersed: the two facts are far apart
    city = s.prompt[a0:a1].split(" lives in ")[1].rstrip(".")
    assert city in s.prompt[b0:b1]


def test_depth_places_the_needle():
    words = lambda text: len(text) // 4  # noqa: E731 - about a real tokenizer's rate
    early = tasks.generate("single", 1, 2048, words, depth=0.1)[0]
    late = tasks.generate("single", 1, 2048, words, depth=0.9)[0]
    assert early.evidence[0][0] / len(early.prompt) < 0.2
    assert late.evidence[0][0] / len(late.prompt) > 0.8


def test_bad_task_arguments():
    with pytest.raises(KvliteError, match="unknown task"):
        tasks.generate("needle", 1, 1024, count)
    with pytest.raises(KvliteError, match="too short"):
        tasks.generate("single", 1, 64, count)
    with pytest.raises(KvliteError, match="depth"):
        tasks.generate("single", 1, 1024, count, depth=1.5)


def test_evidence_token_positions_decode_to_the_statement(tiny_model):
    (s,) = tasks.generate("single", 1, 512, count, seed=3)
    prompt = tokenize(tiny_model, s)
    text = tiny_model.detokenize([prompt.tokens[p] for p in prompt.evidence])
    assert text.strip() == s.prompt[slice(*s.evidence[0])]


def test_sample_i_does_not_depend_on_n():
    few = tasks.generate("twohop", 2, 512, count, seed=1)
    many = tasks.generate("twohop", 5, 512, count, seed=1)
    assert [s.prompt for s in few] == [s.prompt for s in many[:2]]


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_test_split_is_other_prose_and_other_phrasing(task):
    (tune,) = tasks.generate(task, 1, 2048, count, seed=2)
    (test,) = tasks.generate(task, 1, 2048, count, seed=2, split="test")
    assert tune.split == "tune" and test.split == "test" and test.task == f"test:{task}/2048"
    from kvlite.eval.haystack import haystack, news

    assert any(p[:80] in test.prompt for p in news(300)) and not any(p[:80] in test.prompt for p in haystack(400))
    assert any(p[:80] in tune.prompt for p in haystack(400)) and not any(p[:80] in tune.prompt for p in news(300))
    if task != "vt":  # RULER's own wording in both splits
        statements = lambda s: [s.prompt[a:b] for a, b in s.evidence]  # noqa: E731
        assert not set(w for x in statements(tune) for w in x.split()[:3]) & set(
            w for x in statements(test) for w in x.split()[:3]
        )
    for s in (tune, test):  # the closing question is the prompt's last paragraph
        if s.turns is not None:  # a document turn asks nothing
            assert s.question is None and s.prompt.endswith(tasks.READ)
            continue
        assert s.prompt[s.question[0] :].endswith("?") or s.prompt[s.question[0] :].endswith(".")
        assert "\n" not in s.prompt[s.question[0] :]


def test_recall_scores_the_share_of_values_restated():
    from kvlite.eval import metrics

    (s,) = tasks.generate("recall", 1, 1024, count, seed=4)
    assert len(s.answers) == 6 and s.metric == "contains_share"
    assert metrics.score(s.metric, " ".join(s.answers[:3]), s.answers) == 0.5


@pytest.mark.parametrize("task", ["single", "multikey", "twohop"])
def test_paste_shape_is_the_same_document_and_question_without_the_instructions(task):
    own, paste = tasks.generate(task, 2, 1024, count, split="test"), tasks.generate(f"paste-{task}", 2, 1024, count,
                                                                                      split="test")  # fmt: skip
    for a, b in zip(own, paste):
        assert b.task == f"test:paste-{task}/1024" and b.answers == a.answers
        head = a.prompt.split("\n\n", 1)[0]  # the task's instructions, before the document
        assert not b.prompt.startswith(head) and head not in b.prompt
        assert [a.prompt[x:y] for x, y in a.evidence] == [b.prompt[x:y] for x, y in b.evidence]
        assert b.prompt[b.question[0] :] == a.prompt[a.question[0] :]  # the same closing question
        assert 0.9 * 1024 <= count(b.prompt) <= 1.1 * 1024


def test_paste_shape_of_a_conversation_or_unknown_task_is_refused():
    for bad in ("paste-chat", "paste-nope", "nope"):
        with pytest.raises(KvliteError, match="unknown task"):
            tasks.generate(bad, 1, 1024, count)
