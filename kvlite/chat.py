"""`kvlite chat`: a multi-turn REPL over api.Conversation, whose compressed cache persists across
turns. Ctrl-C stops the current reply between tokens; at the prompt it leaves."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

from .api import Session
from .errors import KvliteError
from .policies import Policy
from .settings import RunSettings

HELP = "/reset clears the conversation, /stats shows the cache, /cache the text it kept, /quit leaves (or Ctrl-D)"


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


def run_chat(
    model, policy: Policy, settings: RunSettings, n_predict: int, system: str | None = None, evict: str | None = None
) -> int:
    """The REPL on a loaded model; stdin lines are user turns."""
    session = Session(model, policy, settings)
    conv = session.conversation(system=system, evict=evict)
    interactive = sys.stdin.isatty()
    print(f"kvlite chat: {session.model.info.name}, policy {policy.name}. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        except UnicodeDecodeError:  # stdin with strict decoding
            line = "\udcff"
        text = line.strip()
        try:
            text.encode()
        except UnicodeEncodeError:  # stdin with surrogateescape (the usual)
            print("kvlite: error: that line is not valid UTF-8: type it again", file=sys.stderr)
            continue
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
        if text == "/cache":
            print(f"[cache] {conv.kept_text()}", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text}: {HELP}", file=sys.stderr)
            continue
        with sigint_flag() as flag:
            try:
                _, stopped = conv.turn(text, n_predict, on_text=_echo, interrupted=lambda: flag[0])
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
