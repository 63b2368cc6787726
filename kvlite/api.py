"""The Python API: a model and a policy, then `generate` (one prompt, a fresh cache) or `chat`
(a conversation whose compressed cache persists across turns).

    import kvlite
    s = kvlite.Session(policy=kvlite.EchoKV(budget=256))
    print(s.generate(open("report.txt").read() + "\\nSummarize.", chat=True).text)
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from . import recall_store
from .cache import Snapshot
from .engine import Model, Pool, kvstate
from .engine.model import drop_prefix
from .errors import KvliteError
from .evict import asks_something, chat_ctx, evict_mode, make_room
from .limits import check_int
from .models import resolve_model
from .policies import FullKV, Policy
from .progress import reading
from .reports import Generation
from .runner import Runner
from .settings import RunSettings, plan_context

ROLES = ("system", "user", "assistant")  # of a conversation's messages


def check_text(text: str, what: str) -> None:
    """What every surface refuses in a prompt or a message: nothing to read, or a NUL (llama.cpp's
    template engine reads C strings: it would cut the text there, silently)."""
    if not text.strip():
        raise KvliteError(f"{what} is empty")
    if "\x00" in text:
        raise KvliteError(f"{what} contains a NUL character: remove it")


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvliteError(f"{what} is not valid UTF-8 (byte {e.start}): convert it, e.g. with iconv") from None


def read_text(path: str | pathlib.Path, what: str) -> str:
    """A UTF-8 text file, or a one-line error that says what is wrong with it."""
    try:
        data = pathlib.Path(path).expanduser().read_bytes()
    except OSError as e:
        raise KvliteError(f"cannot read {what} {path}: {e.strerror or e}") from None
    return decode_utf8(data, f"{what} {path}")


class Session:
    def __init__(
        self,
        model: str | pathlib.Path | Model | None = None,
        policy: Policy | None = None,
        settings: RunSettings | None = None,
        n_gpu_layers: int | None = None,
        pool: Pool | None = None,
        **overrides,
    ):
        """model: a GGUF path, a loaded Model, or None for the default (SmolLM2-135M-Instruct);
        settings: how to run it (RunSettings; n_ctx 0 = as needed, see settings.plan_context), or
        its fields as keywords (Session(policy=p, n_ctx=2048)); n_gpu_layers: -ngl when the model is
        loaded here (None: all layers on a GPU build); pool: run every conversation and generation on
        a lane of this shared context (engine.Pool) rather than on a context of its own."""
        try:
            self.settings = dataclasses.replace(settings or RunSettings(), **overrides)
        except TypeError:
            names = ", ".join(f.name for f in dataclasses.fields(RunSettings))
            raise KvliteError(f"unknown run setting in {sorted(overrides)}: the settings are {names}") from None
        self.model = model if isinstance(model, Model) else Model(resolve_model(model), n_gpu_layers=n_gpu_layers)
        self.policy = policy or FullKV()
        self.policy.validate()
        self.pool = pool
        self._conversation: Conversation | None = None

    def _runner(self, policy: Policy, n_ctx: int, n_tokens: int, n_predict: int, recall: int = 0) -> Runner:
        n_ctx, chunk = plan_context(policy, n_ctx, n_tokens, n_predict, self.settings.chunk)
        settings = dataclasses.replace(self.settings, n_ctx=n_ctx, chunk=chunk)
        return Runner(self.model, policy, settings, pool=self.pool, recall=recall)

    def generate(
        self,
        prompt: str,
        n_predict: int = 128,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
        progress: bool = False,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> Generation:
        """Complete one prompt on a fresh cache (chat=True wraps it as a user turn of the template;
        its text is never read as control tokens). progress: a prefill progress bar on stderr when
        it is a terminal. interrupted: checked between chunks and tokens; True stops the run.
        A budget given as a share of the prompt ("2%") keeps that share of this prompt's tokens."""
        check_text(prompt, "the prompt")
        check_int("-n", n_predict)
        if chat:
            tokens = self.model.tokenize_chat([{"role": "user", "content": prompt}])
        else:
            tokens = self.model.tokenize(prompt, add_special=True, parse_special=False)
        runner = self._runner(self.policy.resolve(len(tokens)), self.settings.n_ctx, len(tokens), n_predict)
        try:
            with reading(len(tokens) if progress else 0, runner.chunk + 1, evicting(runner, len(tokens), True)) as bar:
                complete = runner.feed(tokens, progress=bar, interrupted=interrupted)
            out, stopped = [], "interrupted"
            if complete:
                out, stopped = runner.generate(n_predict, on_text=on_text, interrupted=interrupted)
            share = {"budget_share": self.policy.budget} if self.policy.share else {}
            return Generation(
                text=self.model.detokenize(out),
                prompt_tokens=len(tokens),
                generated_tokens=len(out),
                stopped=stopped,
                cache=runner.cache_report(len(tokens)) | share,
                timings=runner.timings.as_dict(),
            )
        finally:
            runner.close()

    def conversation(self, system: str | None = None, evict: str | None = None, recall: int = 0) -> Conversation:
        """A new conversation on its own context: 4096 cells unless the policy evicts continuously
        (then budget + chunk) or n_ctx says otherwise. The context is the cache's cap.
        evict: "eager" evicts to the budget after every turn is read; "lazy" keeps whole turns
        until the next one would not fit under the cap, then reads it and evicts with its queries;
        None: evict_mode's default. recall: keep what is evicted in host memory, and bring back up
        to this many of its cells when a turn has been read, those its queries attend most."""
        if self.model.chat_template is None:
            raise KvliteError(f"{self.model.path.name} has no chat template: use `kvlite generate`")
        self.policy.require_cells("a conversation", "a budget")
        evict = evict_mode(evict, self.policy)
        n_ctx = chat_ctx(self.settings.n_ctx, self.policy)
        return Conversation(self._runner(self.policy, n_ctx, 0, 0, recall), system=system, evict=evict)

    def chat(self, message: str, n_predict: int = 256, on_text: Callable[[str], None] | None = None) -> str:
        """One turn of a conversation; the cache (compressed by the policy) carries over."""
        if self._conversation is None:
            self._conversation = self.conversation()
        reply, _ = self._conversation.turn(message, n_predict, on_text, lambda: False)
        return reply

    def reset(self) -> None:
        """Forget the conversation."""
        if self._conversation is not None:
            self._conversation.reset()


class Conversation:
    """The messages so far and the text of them the cache holds. Each turn feeds only the new text
    (the rendered conversation minus what the cache already holds)."""

    def __init__(self, runner: Runner, system: str | None = None, evict: str = "eager"):
        self.runner = runner
        self.system = system
        self.evict = evict
        self.cap = runner.settings.n_ctx  # the context asked for (llama.cpp may allocate more): the cache's cap
        self.last = ""  # what the last turn's eviction did, for the status line
        self.reset()

    def reset(self) -> None:
        self.runner.cache.reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.rendered = ""  # the text of the conversation the cache holds
        self.primed: tuple[int, ...] = ()  # first-turn tokens already read (start_from)
        self.read, self.decode_rate = 0, 0.0  # the last turn's tokens read and its reply's tok/s (status)
        self.decode_cells = 0  # cells resident when the last reply began (recalled ones included)

    def start_from(self, snapshot: Snapshot) -> None:
        """Begin with the first tokens of the first turn already read, from a snapshot taken
        elsewhere (an evaluation reads a document once for every cell); that turn then feeds only
        the rest. It must begin with exactly the snapshot's tokens."""
        self.reset()
        self.runner.restore(snapshot)
        self.primed = snapshot.tokens

    def resume(self, snapshot: Snapshot, messages: list[dict], rendered: str, evicted: int) -> None:
        """Continue a conversation saved elsewhere (a server's slot file): its cache, its messages,
        the text of them the cache holds, and how many positions it had evicted."""
        self.reset()
        self.runner.restore(snapshot, evicted)
        self.messages, self.rendered = messages, rendered

    def amend_reply(self, text: str) -> None:
        """The last reply as the client keeps it (a server cut it at a stop sequence). The cache
        keeps what was generated; the next turn's rendering decides whether it is read again."""
        self.messages[-1]["content"] = text

    def turn(
        self, user: str | Sequence[dict], n_predict: int, on_text, interrupted, progress: bool = True
    ) -> tuple[str, str]:
        """Feed one user message (or the messages that follow the conversation, the last a user's)
        and generate the reply. Returns (reply, why it stopped)."""
        check_int("-n", n_predict)
        model = self.runner.model
        messages, full, tokens, reread = self._render(user)
        runner, cache = self.runner, self.runner.cache
        if reread:
            cache.reset()
            self.rendered = ""
        if self.primed:
            if tuple(tokens[: len(self.primed)]) != self.primed:
                raise KvliteError("the first turn does not begin with the tokens the conversation started from")
            tokens, self.primed = tokens[len(self.primed) :], ()
        question = asks_something(messages[-1]["content"])
        evict = make_room(runner, self.evict, self.cap, len(tokens), n_predict)
        start, evicted = cache.n_pos, cache.evicted
        timings = dataclasses.replace(runner.timings)
        self.read = 0
        with reading(len(tokens) if progress else 0, runner.chunk + 1, evicting(runner, len(tokens), evict)) as bar:
            try:
                complete = runner.feed(tokens, progress=bar, interrupted=interrupted, evict=evict, question=question)
            except KvliteError:
                cache.truncate(start)
                raise
        if not complete:
            cache.truncate(start)  # forget the half-fed turn; the conversation is as before
            return "", "interrupted"
        self.last = self._describe(cache.evicted - evicted)
        if runner.recall_cells:  # room for the reply (and a lookahead) stays under the cap
            room = self.cap - cache.n_resident - n_predict - runner.policy.lookahead_cells()
            if recalled := runner.recall(room):
                self.last += f", recalled {recalled}"
        self.decode_cells = cache.n_resident
        out, stopped = self.runner.generate(n_predict, on_text=on_text, interrupted=interrupted)
        self.read = len(tokens)
        self.decode_rate = _rate(runner.timings.decode_tokens - timings.decode_tokens,
                                 runner.timings.decode_s - timings.decode_s)  # fmt: skip
        # llama.cpp's template engine reads C strings: a NUL (a tiny or broken model can write one)
        # would end the reply there when the next turn renders it, and the cache would be read again.
        reply = model.detokenize(out).replace("\x00", "")
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        self.rendered = full + reply
        return reply, stopped

    def pending_tokens(self, user: str | Sequence[dict]) -> int:
        """How many tokens a turn with this message would read into the cache."""
        return len(self._render(user)[2]) - len(self.primed)

    def _render(self, user: str | Sequence[dict]) -> tuple[list[dict], str, list[int], bool]:
        """The conversation with the turn's messages appended, its rendered text, the tokens the
        cache lacks, and whether the cache must be read again from the start. The template
        re-renders the whole conversation; the cache holds its prefix (as text: the reply's tokens
        as generated need not be how the text would tokenize), unless the template rewrote it."""
        new = [{"role": "user", "content": user}] if isinstance(user, str) else list(user)
        if not new or new[-1].get("role") != "user":
            raise KvliteError("the last message of a turn must be the user's")
        model = self.runner.model
        messages = [*self.messages, *new]
        pieces = model.chat_segments(messages, add_assistant=True)
        full = "".join(t for t, _ in pieces)
        reread = not full.startswith(self.rendered)
        held = "" if reread else self.rendered
        return messages, full, model.tokenize_pieces(drop_prefix(pieces, len(held)), add_special=not held), reread

    def _describe(self, n_evicted: int) -> str:
        ev = self.runner.last_eviction
        if not n_evicted or ev is None:
            return "nothing evicted"
        return f"evicted {n_evicted}, kept {self.runner.cache.n_resident} ({ev.method})"

    def status(self) -> str:
        c = self.runner.cache
        budget = self.runner.policy.budget
        return (
            f"[{self.evict} | cells {c.n_resident}/{self.cap} | budget {budget if budget else 'none'} | "
            f"evicted {c.evicted} | policy {self.runner.policy.name} | this turn: "
            + (f"read {self.read} tok, {self.last}, {self.decode_rate:.1f} tok/s]" if self.read else "-]")
        )

    def stats(self) -> str:
        c = self.runner.cache
        t = self.runner.timings.as_dict()
        kept = c.positions()
        lines = [
            self.status(),
            f"positions used {c.n_pos}, resident {len(kept)}, max cells {c.max_cells}",
            f"prefill {t['prefill_tokens']} tok in {t['prefill_s']:.2f} s, "
            f"decode {t['decode_tokens']} tok in {t['decode_s']:.2f} s, eviction {t['evict_s'] * 1000:.1f} ms",
        ]
        if self.runner.recall_cells:
            where = "in host memory" if recall_store.in_ram(c.store) else "on disk"
            lines.append(
                f"recall up to {self.runner.recall_cells}: {len(c.stored)} evicted cells stored "
                f"({kvstate.nbytes(c.store) / 2**20:.1f} MiB, {where}), recall {t['recall_s'] * 1000:.1f} ms"
            )
        return "\n".join(lines)

    def kept_text(self) -> str:
        """The text of the cells the cache holds, in position order, with " … " where cells were
        evicted (so two kept pieces never read as one)."""
        cache = self.runner.cache
        kept = cache.positions()
        runs = np.split(kept, np.flatnonzero(np.diff(kept) > 1) + 1)  # contiguous positions
        text = " … ".join(self.runner.model.detokenize(cache.tokens_at(run)) for run in runs)
        head = " … " if len(kept) and kept[0] > 0 else ""
        tail = " … " if len(kept) and kept[-1] < cache.n_pos - 1 else ""
        return head + text + tail


def evicting(runner: Runner, n_new: int, evict: bool) -> str | None:
    """What a progress line says runs once n_new tokens are read, when an eviction will (None: none)."""
    if not evict or runner.policy.continuous or not runner.over_budget(n_new):
        return None
    return f"evicting with {runner.policy.name}"


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0
