"""Progress on stderr: a bar when it is a terminal; for a grid run in the background (stderr a
file), a line per finished cell instead, as a log. A prompt's reading: a bar on a terminal only."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, desc: str, unit: str = "tok", lines: bool = False) -> Iterator[Callable[[int], None]]:
    """Yields an `advance(n)` callable: a bar when stderr is a TTY; else, with lines, one line per
    advance with the count and the time left at the rate so far."""
    tty = sys.stderr.isatty()
    if not (tty or lines):
        yield lambda n: None
        return
    if not tty:
        yield _log_lines(total, desc, unit)
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr) as bar:
        yield bar.update


def _log_lines(total: int, desc: str, unit: str) -> Callable[[int], None]:
    start, done = time.monotonic(), 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        spent = time.monotonic() - start
        left = spent / done * (total - done) if done else 0.0
        print(f"[{desc}] {done}/{total} {unit}s, {_clock(spent)} spent, ~{_clock(left)} left",
              file=sys.stderr, flush=True)  # fmt: skip

    return advance


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


@contextlib.contextmanager
def reading(total: int, min_total: int, then: str | None = None) -> Iterator[Callable[[int], None]]:
    """The progress of reading a prompt, on stderr when it is a terminal, erased when the block
    ends: a bar of the tokens read (with tok/s) from min_total tokens on; then `then`, what runs once
    they are read (an eviction), until the block ends. Yields an `advance(n)` callable."""
    if not total or not sys.stderr.isatty():
        yield lambda n: None
        return
    if total < min_total:
        if then:
            print(f"[{then}...]", end="", file=sys.stderr, flush=True)
        try:
            yield lambda n: None
        finally:
            if then:
                print("\r\x1b[K", end="", file=sys.stderr, flush=True)
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="reading", unit="tok", leave=False, file=sys.stderr) as bar:

        def advance(n: int) -> None:
            bar.update(n)
            if then and bar.n >= total:
                bar.set_postfix_str(f"{then}...")

        yield advance
