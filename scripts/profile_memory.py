"""Where one `kvlite generate`'s memory peaks: the command runs in this process while a thread reads
its RSS every few milliseconds and names the kvlite functions the main thread is in. Prints the
highest RSS of each stretch spent in the same place, where it moved by a MB or more, and the peak.

usage: python scripts/profile_memory.py -f PROMPT.txt --policy echokv --budget 512 -n 16 [generate's flags]
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

PERIOD_S = 0.003


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def where(frame) -> str:
    """The innermost three kvlite functions of a stack, outermost first."""
    names = [
        f"{os.path.basename(s.filename)}:{s.name}" for s in traceback.extract_stack(frame) if "kvlite" in s.filename
    ]
    return " > ".join(names[-3:]) or "?"


def main() -> None:
    main_id = threading.main_thread().ident
    stretches: list[tuple[str, float]] = []  # (where, its highest RSS), one per stretch in one place
    done = threading.Event()

    def sample() -> None:
        here, high = None, 0.0
        while not done.is_set():
            rss, frame = rss_mb(), sys._current_frames().get(main_id)
            now = where(frame) if frame is not None else "?"
            if now != here:
                if here is not None:
                    stretches.append((here, high))
                here, high = now, rss
            high = max(high, rss)
            time.sleep(PERIOD_S)
        stretches.append((here, high))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    from kvlite.cli import main as kvlite_main

    try:
        kvlite_main(["generate", *sys.argv[1:]])
    finally:
        done.set()
        sampler.join()
    last = None
    for place, high in stretches:
        if last is None or abs(high - last) >= 1.0:
            print(f"{high:7.1f} MB  {place}", file=sys.stderr)
        last = high
    place, high = max(stretches, key=lambda s: s[1])
    print(f"peak {high:.1f} MB in {place}", file=sys.stderr)


if __name__ == "__main__":
    main()
