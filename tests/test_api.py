"""The Python API, and the behaviour the lookahead policies exist for."""

from __future__ import annotations

import pytest

import kvlite
from kvlite.eval.haystack import needle_prompt


def test_session_generate_and_chat_on_tiny_model(tiny_paths):
    s = kvlite.Session(tiny_paths["llama"], policy=kvlite.EchoKV(budget=48, lookahead=4, workspace=64))
    g = s.generate("abcdefgh" * 30, n_predict=6)
    assert g.prompt_tokens >= 240 and g.cache["final_cells"] <= 48 + 6
    assert g.cache["workspace_forward_passes"] == 4
    r1 = s.chat("hello " * 40, n_predict=4)
    r2 = s.chat("and again", n_predict=4)
    assert isinstance(r1, str) and isinstance(r2, str)
    s.reset()


def test_a_budget_as_a_share_of_the_prompt(tiny_paths):
    """EchoKV(budget="20%") keeps a fifth of each prompt (rounded down, as kvpress's presses);
    a conversation, which is no one prompt, refuses it before any context is made."""
    s = kvlite.Session(tiny_paths["llama"], policy=kvlite.EchoKV(budget="20%", lookahead=4, workspace=128))
    for text in ("abcdefgh" * 30, "abcdefgh" * 50):
        g = s.generate(text, n_predict=2)
        assert (g.cache["budget"], g.cache["budget_share"]) == (g.prompt_tokens // 5, "20%")
        assert g.cache["evicted"] == g.prompt_tokens - g.prompt_tokens // 5
    with pytest.raises(kvlite.KvliteError, match="a conversation needs a budget in KV cells"):
        s.chat("hello")


NEEDLE = "The locker code of Orla Bren is 54554."
QUESTION = "What is the locker code of Orla Bren?"


@pytest.mark.slow
@pytest.mark.parametrize("policy,answers", [("echokv", True), ("laq", True), ("streaming", False)])
@pytest.mark.model_answer
def test_needle_at_budget_128(policy, answers):
    """A code stated once at 20% depth of ~1.2K tokens, the question at the end (SmolLM2 answers it
    with the full cache). Lookahead queries find it at budget 128; a recency window cannot."""
    prompt = needle_prompt(14, 0.2, NEEDLE, QUESTION)
    s = kvlite.Session(policy=kvlite.make_policy(policy, budget=128))
    g = s.generate(prompt, n_predict=24, chat=True)
    assert g.prompt_tokens > 1000 and g.cache["final_cells"] <= 128 + 24
    assert ("54554" in g.text) == answers, g.text
