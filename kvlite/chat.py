"""`kvlite chat`: a multi-turn REPL over api.Conversation, whose compressed cache persists across
turns. Messages come from kvlite.chat_input (a line editor in a terminal, lines otherwise); files
come in with -f and /read; /save and /load keep a conversation in a slot file. Ctrl-C stops the
current reply between tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
import sys
from collections.abc import Iterator, Sequence

from .api import Conversation, Session, check_text, read_text
from .chat_input import LineInput, TerminalInput, data_dir, describe_text
from .engine import Model
from .errors import KvliteError
from .policies import Policy
from .settings import RunSettings
from .slotfile import SlotFile, read_slot_file, write_slot_file

HELP = """commands:
  /read FILE [question]  read a file as your message, the question after it in the same message
  /save NAME             save the conversation, its compressed cache included ({chats}/NAME)
  /load NAME             continue a saved conversation, under the policy it was saved with
  /stats  the cache and timings          /cache   the text the cache kept
  /policy the policy and its parameters  /reset   start over
  /help   this                           /quit, /bye or Ctrl-D  leave
A paste is one message. A message that begins with \"\"\" runs to the line that ends with \"\"\"."""
QUIT = ("/quit", "/exit", "/bye")


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


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def chat_path(name: str) -> pathlib.Path:
    """Where /save NAME and /load NAME keep a conversation: a bare name in data_dir()/chats, a path
    (with a slash, or ~) as given."""
    if not name:
        raise KvliteError("name the conversation: /save NAME, /load NAME")
    if "/" in name or name.startswith("~"):
        return pathlib.Path(name).expanduser()
    return data_dir() / "chats" / name


def read_saved(name: str, model_path: pathlib.Path) -> SlotFile:
    path = chat_path(name)
    if not path.exists():
        raise KvliteError(f"no saved conversation {name} ({path}): /save {name} in a chat makes one")
    return read_slot_file(path, str(path.parent), model_path)


def read_document(path: str, question: str = "") -> str:
    """A file as one message (the question after it), with every surface's checks."""
    text = read_text(path, "file")
    check_text(text, f"the file {path}")
    if question:
        text = f"{text.rstrip()}\n\n{question}"
    check_text(text, "the message")
    return text


def split_path(arg: str) -> tuple[str, str]:
    """/read's argument: a path (in quotes if it has spaces) and what follows it."""
    arg = arg.strip()
    if arg[:1] in ("'", '"') and arg.find(arg[0], 1) > 0:
        end = arg.find(arg[0], 1)
        return arg[1:end], arg[end + 1 :].strip()
    path, _, rest = arg.partition(" ")
    return path, rest.strip()


@dataclasses.dataclass
class Chat:
    """The conversation and how to run it, which /load replaces."""

    model: Model
    settings: RunSettings
    n_predict: int
    system: str | None
    conv: Conversation | None = None

    def turn(self, text: str) -> None:
        with sigint_flag() as flag:
            try:
                _, stopped = self.conv.turn(text, self.n_predict, on_text=_echo, interrupted=lambda: flag[0])
            except KvliteError as e:
                note(f"\nkvlite: error: {e} (/reset starts over)")
                return
        sys.stdout.write("\n")
        sys.stdout.flush()
        note(self.conv.status() + (" (stopped)" if stopped == "interrupted" else ""))

    def read_file(self, path: str, question: str = "") -> None:
        self.document(path, read_document(path, question))

    def document(self, path: str, text: str) -> None:
        note(f"[read {path}: {describe_text(text)}]")
        self.turn(text)

    def resume(self, saved: SlotFile, name: str) -> None:
        """Continue a saved conversation in place of this one (which stays if that fails)."""
        settings = dataclasses.replace(self.settings, n_ctx=self.settings.n_ctx or saved.cap or 0)
        conv = Session(self.model, saved.policy(), settings).conversation(self.system, saved.meta["evict"],
                                                                          saved.recall)  # fmt: skip
        try:
            saved.check_layout(conv, name)
            saved.restore(conv, saved.snapshot(conv.runner.cache.hidden_layer))
        except BaseException:
            conv.runner.close()
            raise
        if self.conv is not None:
            self.conv.runner.close()
        self.conv = conv
        note(f"[loaded {name}: {len(conv.messages)} messages, {conv.runner.cache.n_resident} cells] {conv.status()}")

    def command(self, text: str) -> bool:
        """Run a /command. Returns False to leave."""
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        conv = self.conv
        if name in QUIT:
            return False
        if name == "/help":
            note(HELP.format(chats=data_dir() / "chats"))
        elif name == "/reset":
            conv.reset()
            note("[conversation cleared]")
        elif name == "/stats":
            note(conv.stats())
        elif name == "/cache":
            note(f"[cache] {conv.kept_text()}")
        elif name == "/policy":
            note(f"[{conv.runner.policy!r}, {conv.evict} eviction, cap {conv.cap} cells]")
        elif name == "/read":
            if not arg:
                raise KvliteError("/read FILE [question]: name the file")
            self.read_file(*split_path(arg))
        elif name == "/save":
            if not conv.messages or conv.messages[-1]["role"] != "assistant":
                raise KvliteError("nothing to save yet: the conversation has no reply")
            path = chat_path(arg)
            if path.parent == data_dir() / "chats":
                path.parent.mkdir(parents=True, exist_ok=True)
            write_slot_file(path, conv, self.model)
            note(f"[saved {len(conv.messages)} messages, {conv.runner.cache.n_resident} cells to {path}]")
        elif name == "/load":
            self.resume(read_saved(arg, self.model.path), arg)
        else:
            note(f"unknown command {name}: /help lists the commands")
        return True


def run_chat(model: Model, policy: Policy, settings: RunSettings, n_predict: int, system: str | None = None,
             evict: str | None = None, files: Sequence[tuple[str, str]] = (),
             saved: tuple[str, SlotFile] | None = None, recall: int = 0) -> int:  # fmt: skip
    """The REPL on a loaded model: first the saved conversation (saved: its name and file), then
    the files as messages (files: each one's path and text, read_document's), then what the user
    types."""
    chat = Chat(model, settings, n_predict, system)
    if saved is not None:
        chat.resume(saved[1], saved[0])
    else:
        chat.conv = Session(model, policy, settings).conversation(system, evict, recall)
    note(f"kvlite chat: {model.info.name}, policy {chat.conv.runner.policy.name}. /help lists the commands; "
         "a paste is one message; Ctrl-D leaves")  # fmt: skip
    for path, text in files:
        chat.document(path, text)
    if sys.stdin.isatty():
        source = TerminalInput(note)
    else:
        source = LineInput(sys.stdin.buffer, _error, lambda text: note(f"kvlite: note: {text}"))
    while (entry := source.read()) is not None:
        text = entry.text
        if not text.strip():
            continue
        try:
            if text.startswith("/") and not entry.verbatim:
                if not chat.command(text):
                    break
                continue
            check_text(text, "the message")
            text.encode()
        except UnicodeEncodeError:  # a terminal's bytes that are not UTF-8 arrive as lone surrogates
            _error("that message is not valid UTF-8: type it again")
            continue
        except KvliteError as e:
            _error(str(e))
            continue
        chat.turn(text)
    return 0


def _error(text: str) -> None:
    note(f"kvlite: error: {text}")


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
