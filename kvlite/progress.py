"""Progress bars for long prefills and runs, on stderr and only when it is a terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, desc: str, min_total: int = 0, unit: str = "tok") -> Iterator[Callable[[int], None]]:
    """Yields an `advance(n)` callable; a no-op unless stderr is a TTY and total >= min_total."""
    if total < min_total or not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr) as bar:
        yield bar.update
