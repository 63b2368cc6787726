"""Where `kvlite chat` reads its messages. In a terminal, a line editor (prompt_toolkit): a paste
is one message, shown as a one-line placeholder, with history and editing. Otherwise (a pipe, a
file) one message per line. On both, a message that opens with triple quotes runs to the line
that ends with them (Ollama's multi-line message). Neither ever cuts a message short.

prompt_toolkit over GNU readline: readline's bracketed paste puts a pasted document into the one
line being edited, with no placeholder, no way to tell a paste from typing, and no multi-line
editing; prompt_toolkit gives each paste as one event and is what IPython, pgcli and aider use."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys

BLOCK = '"""'
LEAVE_HINT = "(Ctrl-C again or Ctrl-D leaves; /help lists the commands)"
# A paste longer than this, or of more than one line, shows as a placeholder (the text is sent).
INLINE_PASTE = 200
PLACEHOLDER = re.compile(r"\[paste #(\d+): [^\]\n]*\]")


@dataclasses.dataclass
class Entry:
    """One message as the user gave it. verbatim: from a paste or a triple-quoted block, never a command."""

    text: str
    verbatim: bool = False


def data_dir() -> pathlib.Path:
    """kvlite's folder for the user's data (chat history, saved chats): $XDG_DATA_HOME/kvlite."""
    base = os.environ.get("XDG_DATA_HOME") or pathlib.Path.home() / ".local" / "share"
    return pathlib.Path(base) / "kvlite"


def opens_block(text: str) -> bool:
    return text.lstrip().startswith(BLOCK)


def closes_block(text: str) -> bool:
    """Whether a block's text so far (its opening quotes included) has ended."""
    body = text.strip()
    return len(body) >= 2 * len(BLOCK) and body.endswith(BLOCK)


def unquote(text: str) -> str:
    body = text.strip()
    return body[len(BLOCK) : -len(BLOCK) if closes_block(body) else None].strip("\n")


def describe_text(text: str) -> str:
    """A pasted or read document's size, as its placeholder and the chat's notes give it."""
    lines = text.count("\n") + (not text.endswith("\n"))
    size = len(text.encode())
    amount = f"{size / 1024:.1f} KB" if size >= 1024 else f"{size} bytes"
    return f"{lines} line{'s' if lines != 1 else ''}, {amount}"


class LineInput:
    """Messages from a stream that is not a terminal: one per line, or a triple-quoted block. A line that is
    not UTF-8 is reported (on_error) and skipped, block and all."""

    def __init__(self, stream, on_error, on_note):
        self.stream, self.on_error, self.on_note = stream, on_error, on_note

    def read(self) -> Entry | None:
        """The next message, or None at the end of the input."""
        while True:
            line = self._line()
            if line is None:
                return None
            if line is False:
                continue
            if not opens_block(line):
                return Entry(line.strip())
            lines = [line]
            while not closes_block("\n".join(lines)):
                more = self._line()
                if more is None:  # the input ended inside the block: what it holds is still the message
                    self.on_note(f"the input ended inside a {BLOCK} block: its {len(lines)} lines are sent as one "
                                  "message")  # fmt: skip
                    break
                if more is False:
                    lines = None
                    break
                lines.append(more)
            if lines is not None:
                return Entry(unquote("\n".join(lines)), verbatim=True)

    def _line(self) -> str | None | bool:
        """A line without its end; None at the end of input; False for one that is not UTF-8."""
        data = self.stream.readline()
        if not data:
            return None
        try:
            return data.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            self.on_error("that line is not valid UTF-8: type it again")
            return False


class TerminalInput:
    """prompt_toolkit's editor: a paste (bracketed) is one event, kept whole and shown as a
    placeholder that Backspace removes as one; Enter inside a triple-quoted block starts a new line;
    Ctrl-C clears the line, and at an empty prompt twice in a row leaves; Ctrl-D at an empty one
    leaves. History is kept in data_dir()/chat_history, except messages with a paste in them."""

    def __init__(self, on_note):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.output import create_output

        self.on_note = on_note
        self.pastes: dict[int, str] = {}
        self.armed = False  # a Ctrl-C at an empty prompt was the last key: the next leaves
        output = None if sys.stdout.isatty() else create_output(stdout=sys.stderr)
        self.session = PromptSession(history=self._history(), key_bindings=self._bindings(), output=output,
                                     prompt_continuation=lambda width, *_: "." * (width - 1) + " ")  # fmt: skip
        self.session.default_buffer.on_text_changed += self._disarm  # typing disarms the second Ctrl-C

    def _disarm(self, _buffer) -> None:
        self.armed = False

    def _history(self):
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        class History(FileHistory):
            def store_string(self, string: str) -> None:
                if not PLACEHOLDER.search(string):  # the pastes are this session's only
                    super().store_string(string)

        path = data_dir() / "chat_history"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            return History(str(path))
        except OSError as e:
            self.on_note(f"history is not kept across runs: cannot write {path} ({e.strerror or e})")
            return InMemoryHistory()

    def _bindings(self):
        from prompt_toolkit.key_binding import KeyBindings
        from prompt_toolkit.keys import Keys

        kb = KeyBindings()

        @kb.add(Keys.BracketedPaste)
        def paste(event) -> None:
            text = event.data.replace("\r\n", "\n").replace("\r", "\n")  # terminals paste lines with CR
            if "\n" not in text.rstrip("\n") and len(text) <= INLINE_PASTE:
                event.current_buffer.insert_text(text.rstrip("\n"))
                return
            n = len(self.pastes) + 1
            self.pastes[n] = text
            event.current_buffer.insert_text(f"[paste #{n}: {describe_text(text)}]")

        @kb.add("enter")
        def enter(event) -> None:
            buf = event.current_buffer
            if opens_block(buf.text) and not closes_block(buf.text):
                buf.insert_text("\n")
            else:
                buf.validate_and_handle()

        @kb.add("backspace")
        def backspace(event) -> None:
            buf = event.current_buffer
            whole = re.search(PLACEHOLDER.pattern + "$", buf.document.text_before_cursor)
            buf.delete_before_cursor(len(whole.group()) if whole else event.arg)

        @kb.add("c-c")
        def ctrl_c(event) -> None:
            buf = event.current_buffer
            if buf.text:
                buf.reset()
                self.armed = False
            else:
                event.app.exit(exception=KeyboardInterrupt)

        return kb

    def read(self) -> Entry | None:
        """The next message, or None when the user leaves."""
        while True:
            try:
                text = self.session.prompt("> ")
            except EOFError:
                return None
            except KeyboardInterrupt:
                if self.armed:
                    return None
                self.armed = True
                self.on_note(LEAVE_HINT)
                continue
            self.armed = False
            verbatim = bool(PLACEHOLDER.search(text)) or opens_block(text)
            if opens_block(text):
                text = unquote(text)
            text = PLACEHOLDER.sub(lambda m: self.pastes.get(int(m.group(1)), m.group()), text)
            return Entry(text if verbatim else text.strip(), verbatim)
