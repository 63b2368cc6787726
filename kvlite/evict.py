"""When a conversation evicts: the chat eviction modes, their defaults, the room a turn needs, and
whether a turn asks something. Every surface (api, cli, serve, eval) takes these from here.

- eager: evict to the budget after every turn is read.
- lazy: keep whole turns until the next one (and its reply) would not fit under the cache's cap,
  then read it and evict with its queries, so a question asked a turn after its document is
  answered from the document (docs/policies.md, "Chat: when to evict").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import KvliteError
from .limits import check_int

if TYPE_CHECKING:  # light to import: the CLI builds its flags from MODES before loading llama.cpp
    from .policies import Policy
    from .runner import Runner

MODES = ("eager", "lazy")
# kvlite chat's and serve's mode where none is asked for, chosen on the tune split by
# scripts/pick_chat_default.py (docs/policies.md, "Chat: when to evict").
DEFAULT = "lazy"
# The evaluation grid's, different on purpose: a grid cell names its mode (`snapkv(evict=lazy)`),
# and a spec without one has always meant eager, the per-turn eviction the papers evaluate; a
# default that followed chat's would change what recorded cells mean.
GRID_DEFAULT = "eager"
# A conversation's length is unknown: the context (the cache's cap) of one not evicted continuously.
CHAT_CTX = 4096
# What `--recall` takes without a number: scripts/pick_recall.py's pick on the tune split
# (results-runs/recall-tune-smol-1024/pick.json). Recall stays off unless asked for: it adds up to
# N cells beyond the budget to what decode attends.
RECALL_PICK = 32
# The host memory the stores of evicted cells may take without --recall-store: this share of the
# memory available when the first is kept (kvlite/recall_store.py; beyond it they go to disk).
RECALL_STORE_SHARE = 0.25
# Whether recall scores with the queries of an eager eviction's lookahead beside the turn's own
# (scripts/pick_recall.py --queries, on the tune split's recall-queries stage).
RECALL_LOOKAHEAD = False
# A message asks something when it has a question mark near its end or opens with one of these
# (a pasted document with a "?" in its middle does not). The hybrid policy reads it per turn.
_ASKING = ("what", "who", "whom", "whose", "when", "where", "which", "why", "how", "is", "are", "does", "do", "did",
           "can", "could", "tell", "give", "list", "name", "summarize", "explain", "describe", "repeat")  # fmt: skip


def check_evict(evict: str | None) -> None:
    """A chat eviction mode kvlite knows (None: the default)."""
    if evict is not None and evict not in MODES:
        raise KvliteError(f"--evict must be one of {', '.join(MODES)}, got '{evict}'")


def evict_mode(evict: str | None, policy: Policy, default: str = DEFAULT) -> str:
    """The chat eviction mode a conversation runs: the one asked for, or else `default` (chat's
    DEFAULT; a grid's GRID_DEFAULT) where lazy applies (a prefill-end policy with a budget) and
    eager where it does not (the full cache never evicts; chunked mode evicts as it reads)."""
    lazy_applies = policy.budget is not None and not policy.continuous
    check_evict(evict)
    if evict is None:
        return default if lazy_applies else "eager"
    if evict == "lazy" and not lazy_applies:
        raise KvliteError("--evict lazy needs a prefill-end policy with a --budget (chunked mode evicts as it reads)")
    return evict


def check_recall(recall: object, policy: Policy, flag: str = "--recall") -> int:
    """How many evicted cells a conversation may bring back after a turn (0: none, the default):
    scored with the queries of the turn just read, so only for a policy that captures them, and
    not in chunked mode, which evicts while it reads."""
    recall = check_int(flag, recall)
    if recall and policy.continuous:
        raise KvliteError(f"{flag} brings cells back after a turn is read: chunked mode evicts as it reads")
    if recall and not policy.observes_queries:
        raise KvliteError(f"{flag} scores evicted cells with the queries of the turn just read: policy "
                          f"{policy.name} captures none (snapkv, tova, h2o, laq, echokv and kvzip do)")  # fmt: skip
    return recall


def chat_ctx(n_ctx: int, policy: Policy) -> int:
    """The context a conversation (or a server's completion) allocates: -c if given, else CHAT_CTX
    cells, or 0 (planned as budget + chunk) for a policy that evicts as it reads."""
    return n_ctx or (0 if policy.continuous else CHAT_CTX)


def asks_something(message: str) -> bool:
    text = message.strip()
    words = text.split(maxsplit=1)
    return "?" in text[-300:] or (bool(words) and words[0].lower().strip(",:") in _ASKING)


def make_room(runner: Runner, evict: str, cap: int, n_new: int, n_predict: int) -> bool:
    """Whether a turn of n_new tokens evicts once it is read. Eager: always (the policy's budget
    decides). Lazy: only when the turn and its reply would not fit under the cap; if the turn does
    not even fit beside what is resident, evict first with what the last turn observed. A turn that
    cannot fit is refused here, from its token count, before any eviction or prefill."""
    cache = runner.cache
    extra = runner.policy.lookahead_cells()
    if evict == "eager":
        # A policy that evicts only once the turn is read needs room for all of it: said now,
        # not after prefilling up to the cap.
        if not runner.policy.continuous and cache.n_resident + n_new + extra > cap:
            raise KvliteError(f"a message of {n_new} tokens does not fit in the context beside the "
                              f"{cache.n_resident} cells it holds (cap {cap}): raise -c or evict in "
                              "--mode chunked")  # fmt: skip
        return True
    budget = runner.policy.budget
    if budget + n_predict + extra > cap:
        raise KvliteError(f"--budget {budget} with -n {n_predict} does not fit under the cache cap {cap}")
    if cache.n_resident + n_new + n_predict + extra <= cap:
        return False
    if min(cache.n_resident, budget) + n_new + extra > cap:
        raise KvliteError(f"a message of {n_new} tokens does not fit under the cache cap {cap} beside the "
                          f"budget {budget}: raise -c")  # fmt: skip
    if cache.n_resident + n_new + extra > cap:
        runner.evict()
    return True
