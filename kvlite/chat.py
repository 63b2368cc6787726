"""`kvlite chat`: a multi-turn REPL on the model's chat template whose compressed cache persists
across turns. Each turn feeds only the new text (the rendered conversation minus what the cache
already holds). Ctrl-C stops the current reply between tokens; at the prompt it leaves."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

from .engine import Model, SamplingParams
from .errors import KvliteError
from .models import resolve_model
from .policies import Policy
from .progress import progress_bar
from .runner import Runner

CHAT_CTX = 4096  # a conversation's length is unknown: the context of one not evicted continuously

HELP = "/reset clears the conversation, /stats shows the cache, /quit leaves (or Ctrl-D)"


class Conversation:
    """The messages so far and the text of them the cache holds."""

    def __init__(self, runner: Runner, system: str | None = None):
        self.runner = runner
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.runner.cache.reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.rendered = ""

    def turn(self, user: str, n_predict: int, on_text, interrupted) -> tuple[str, str]:
        """Feed one user message and generate the reply. Returns (reply, why it stopped)."""
        model = self.runner.model
        messages = [*self.messages, {"role": "user", "content": user}]
        full = model.apply_chat_template(messages, add_assistant=True)
        # The template re-renders the whole conversation; the cache already holds its prefix.
        new_text = full[len(self.rendered) :] if full.startswith(self.rendered) else full
        tokens = model.tokenize(new_text, add_special=not self.rendered, parse_special=True)
        cache = self.runner.cache
        start = cache.n_pos
        with progress_bar(len(tokens), "prefill", min_total=2 * self.runner.chunk) as bar:
            try:
                complete = self.runner.feed(tokens, progress=bar, interrupted=interrupted)
            except KvliteError:
                cache.truncate(start)
                raise
        if not complete:
            cache.truncate(start)  # forget the half-fed turn; the conversation is as before
            return "", "interrupted"
        out, stopped = self.runner.generate(n_predict, on_text=on_text, interrupted=interrupted)
        reply = model.detokenize(out)
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        self.rendered = full + reply
        return reply, stopped

    def status(self) -> str:
        c = self.runner.cache
        budget = self.runner.policy.budget
        return (
            f"[cells {c.n_resident}/{self.runner.ctx.n_ctx} | budget {budget if budget else 'none'} | "
            f"evicted {c.evicted} | policy {self.runner.policy.name}]"
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
        return "\n".join(lines)


@contextlib.contextmanager
def sigint_flag() -> Iterator[list[bool]]:
    """Turn Ctrl-C into a flag checked between tokens, so llama.cpp is never interrupted mid-call."""
    flag = [False]

    def handler(signum, frame):
        flag[0] = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(args, policy: Policy, sampling: SamplingParams) -> int:
    from .api import Session

    model = Model(resolve_model(args.model), use_extra_bufts=args.extra_bufts)
    if model.chat_template is None:
        raise KvliteError(f"{model.path.name} has no chat template: use `kvlite generate`")
    session = Session(model, policy, n_ctx=args.ctx_size, chunk=args.chunk, sampling=sampling,
                      n_threads=args.threads, flash_attn=args.flash_attn)  # fmt: skip
    conv = session.conversation(system=args.system)
    interactive = sys.stdin.isatty()
    print(f"kvlite chat: {model.info.name}, policy {policy.name}. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            conv.reset()
            print("[conversation cleared]", file=sys.stderr)
            continue
        if text == "/stats":
            print(conv.stats(), file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text}: {HELP}", file=sys.stderr)
            continue
        with sigint_flag() as flag:
            try:
                _, stopped = conv.turn(text, args.n_predict, on_text=_echo, interrupted=lambda: flag[0])
            except KvliteError as e:
                print(f"\nkvlite: error: {e} (/reset starts over)", file=sys.stderr)
                continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        note = " (stopped)" if stopped == "interrupted" else ""
        print(conv.status() + note, file=sys.stderr)
    return 0


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
