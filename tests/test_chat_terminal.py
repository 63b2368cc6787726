"""`kvlite chat` in a real pseudo-terminal, as a user's terminal runs it: pastes arrive in
bracketed-paste markers, keys are bytes, the screen is what the program draws. Not stdin
redirection: the line editor, the terminal's modes and Ctrl-C only exist on a terminal."""

from __future__ import annotations

import fcntl
import os
import pathlib
import re
import struct
import subprocess
import termios
import threading
import time

import llama_cpp
import pytest
from conftest import KVLITE

DOC = pathlib.Path(__file__).parent.parent / "docs" / "needle.txt"
PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"
ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]|\x1b[=>]")
STATUS = re.compile(r"\[(?:lazy|eager) \| cells (\d+)/\d+ .*?this turn: read (\d+) tok")


class Terminal:
    """A program on a pseudo-terminal that is its controlling terminal (so Ctrl-C is SIGINT while
    it is not reading keys), 160 columns wide. It answers the cursor-position queries a terminal
    answers; everything the program writes is kept."""

    def __init__(self, args: list[str], env: dict, cols: int = 160, rows: int = 50):
        self.rows = rows
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

        def own_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     preexec_fn=own_terminal, cwd="/tmp")  # fmt: skip
        os.close(slave)
        self.out = b""
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the program ended: the terminal is gone
                return
            if not data:
                return
            with self.lock:
                self.out += data
            if b"\x1b[6n" in data:  # where the cursor is: the bottom row, as after a screen of output
                os.write(self.master, b"\x1b[%d;1R" % self.rows)

    def send(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.master, data) :]

    def paste(self, text: str) -> None:
        """As a terminal pastes: in bracketed-paste markers, lines ended by CR."""
        self.send(PASTE_START + text.replace("\n", "\r").encode() + PASTE_END)

    def screen(self, since: int = 0) -> str:
        """What was written since the byte `since`, without the terminal's control sequences."""
        with self.lock:
            data = self.out[since:]
        return ANSI.sub(b"", data).decode(errors="replace").replace("\r", "")

    def mark(self) -> int:
        with self.lock:
            return len(self.out)

    def wait_for(self, pattern: str, since: int = 0, timeout: float = 300) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = re.search(pattern, self.screen(since))
            if found:
                return found
            if self.proc.poll() is not None:
                time.sleep(0.2)
                found = re.search(pattern, self.screen(since))
                if found:
                    return found
                raise AssertionError(f"kvlite ended ({self.proc.returncode}) before {pattern!r}:\n{self.screen()}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in {timeout} s:\n{self.screen(since)}")

    def prompt(self, since: int = 0, timeout: float = 300) -> None:
        """Wait for the line editor to take keys: it turns on bracketed paste when it starts reading."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if b"\x1b[?2004h" in self.out[since:]:
                    return
            if self.proc.poll() is not None:
                raise AssertionError(f"kvlite ended ({self.proc.returncode}) before its prompt:\n{self.screen()}")
            time.sleep(0.05)
        raise AssertionError(f"no prompt in {timeout} s:\n{self.screen(since)}")

    def turn(self, keys: bytes, timeout: float = 300) -> tuple[str, re.Match]:
        """Send keys that end a message; the screen until the status line after its reply, and that line."""
        since = self.mark()
        self.send(keys)
        status = self.wait_for(STATUS.pattern, since, timeout)
        self.prompt(since, timeout)
        return self.screen(since), status

    def close(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc.kill()
            os.close(self.master)


def tokens_of(model_path: str, text: str) -> int:
    """The text's token count by llama-cpp-python's tokenizer, not kvlite's chat rendering."""
    llm = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    return len(llm.tokenize(text.encode(), add_bos=False, special=False))


@pytest.fixture()
def chat_env(tmp_path) -> dict:
    return dict(os.environ, TERM="xterm-256color", XDG_DATA_HOME=str(tmp_path), PYTHONUNBUFFERED="1")


def start(env: dict, *args: str) -> Terminal:
    term = Terminal([KVLITE, "chat", *args], env)
    term.prompt(timeout=120)
    return term


@pytest.mark.slow
@pytest.mark.model_answer
def test_a_pasted_document_is_one_turn_and_its_question_is_answered(chat_env, smol_path):
    """The issue-58 case: docs/needle.txt (33 lines, its question last) pasted whole, then the
    question on its own, at 128 cells. Eager eviction, so the document is cut to the budget
    before the question's turn: the default lazy mode would hold it whole in the 4096-cell cap.
    SmolLM2 answers 54554 from the 128 cells, which do not hold the code's digits (the kept cells
    of the question attended to them while it was read), on the native, AVX2 and generic builds
    (scripts/cpu_variants.sh)."""
    doc = DOC.read_text()
    assert doc.count("\n") == 33
    term = start(chat_env, "--policy", "echokv", "--budget", "128", "--evict", "eager", "-n", "32")
    since = term.mark()
    term.paste(doc)
    term.wait_for(r"\[paste #1: 33 lines, 5\.5 KB\]", since, 30)
    screen, status = term.turn(b"\r")
    n_doc = tokens_of(smol_path, doc)
    # one turn of the whole document: its tokens and the template's few (a line per turn would
    # read the first line alone, a cut one fewer than the document's)
    assert n_doc <= int(status.group(2)) <= n_doc + 64, (n_doc, status.group())
    assert int(status.group(1)) <= 128 + 32, status.group()
    # while it was read: the bar of tokens and tok/s, then the eviction (erased before the reply)
    assert re.search(r"reading: .*\d+/\d+ .*tok/s", screen) and "evicting with echokv..." in screen, screen
    _, status = term.turn(b"What is the locker code of Orla Bren?\r")
    assert int(status.group(2)) < 64, status.group()
    screen = term.screen()
    reply = screen[screen.rindex("Orla Bren?") : screen.rindex("[eager |")]
    assert "54554" in reply, reply
    for line in doc.splitlines()[2:-1]:  # the paste was shown as its placeholder, no line of it
        assert not line.strip() or "Orla Bren" in line or line[:60] not in screen, line  # (the reply says hers)
    term.send(b"\x04")
    assert term.close() == 0, term.screen()


def test_a_40kb_line_reaches_the_model_whole(chat_env, tiny_paths):
    """A 40 KB line, pasted: the terminal's canonical line buffer keeps 4,095 bytes of a line,
    and input() read only those. The line editor reads keys raw, and every token is read. (The
    tiny model's tokens are characters: StreamingLLM in chunked mode reads the 47K of them in
    seconds, where the full cache's attention over all of them took 100 s.)"""
    words = " ".join(f"w{i}" for i in range(8000))
    line = f"BEGIN-7731 {words} END-7731"
    assert len(line.encode()) > 40_000
    n_line = tokens_of(tiny_paths["llama"], line)
    term = start(chat_env, "-m", tiny_paths["llama"], "-n", "4", "--policy", "streaming", "--cache", "256")
    term.paste(line)
    _, status = term.turn(b"\r")
    assert n_line <= int(status.group(2)) <= n_line + 64, (n_line, status.group())
    since = term.mark()
    term.send(b"/cache\r")
    term.prompt(since)
    kept = term.screen(since)
    assert "w7998 w7999 END-7731" in kept, kept[-300:]  # the window: the line's end and the reply
    term.send(b"\x04")
    assert term.close() == 0


def test_keys_at_the_prompt(chat_env, tiny_paths):
    """A triple-quoted block typed line by line is one message; Ctrl-C clears a line, and at an empty
    prompt says how to leave, then leaves on the second press."""
    term = start(chat_env, "-m", tiny_paths["llama"], "-n", "4")
    term.turn(b'"""\rfirst line\rsecond line\r"""\r')
    since = term.mark()
    term.send(b"/cache\r")
    term.prompt(since)
    term.wait_for(r"user\n ?first line\nsecond line ?<\|im_end\|>", since, 1)  # one message, both lines
    since = term.mark()
    term.send(b"half a thought\x03")
    term.send(b"\x03")
    term.wait_for(r"Ctrl-C again or Ctrl-D leaves", since, 30)
    term.prompt(since, 30)  # the prompt again, after the note
    term.send(b"\x03")
    assert term.close() == 0
    assert "half a thought" not in term.screen(since).split("Ctrl-C again")[1]
