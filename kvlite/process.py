"""The command line's process: its standard streams, its allocator and a Ctrl-C that Python cannot
raise. Set up by `kvlite.cli.main` only: the Python API leaves its host process alone."""

from __future__ import annotations

import contextlib
import os
import sys

from .errors import KvliteError

EXIT_INTERRUPTED = 130
CLOSED: set[str] = set()  # the standard streams kvlite was started without (guard_streams)


def return_freed_memory() -> None:
    """glibc serves a large block from the heap once a block that size was freed (its mmap
    threshold grows), and a freed heap block stays in RSS: an eviction's per-layer buffers then
    lift the peak for good (what it cost kvzip: docs/cache.md, "Memory and speed"). A fixed
    threshold maps every block of 128 KiB or more on its own and unmaps it when freed. Set by the
    command line only: the Python API leaves the host process's allocator alone."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it also fixes it


def guard_streams() -> None:
    """Started with stdin, stdout or stderr closed (`>&-`), Python has None for it, and the next
    file kvlite or llama.cpp opens would take its descriptor: a model file or a state export would
    then receive what is printed. Each closed one is opened on /dev/null instead (the lowest free
    descriptor is its own), and named in CLOSED so that a command needing it can say so."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115
            CLOSED.add(name)


def needs_stdout(what: str) -> None:
    if "stdout" in CLOSED:
        raise KvliteError(f"stdout is closed: {what} would be lost; give kvlite an output (a file, a pipe)")


def unraisable(info) -> None:
    """A Ctrl-C that lands in a callback Python cannot raise from (a weakref callback of the import
    system's module locks, a __del__) would be printed as an ignored traceback and lost, and the
    run would go on: it ends the run with the same line instead. There is nothing left to unwind
    to (the frame that could catch it is gone), so the process exits here."""
    if issubclass(info.exc_type, KeyboardInterrupt):
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.write(2, b"\nkvlite: interrupted\n")
        os._exit(EXIT_INTERRUPTED)
    sys.__unraisablehook__(info)


def import_numpy_uninterrupted() -> None:
    """Import numpy with Ctrl-C held until it is done. Its C initialisation imports `datetime`
    through the C API, which turns a KeyboardInterrupt raised there into an ImportError (a
    traceback instead of one line). A Ctrl-C that arrives meanwhile is raised as
    KeyboardInterrupt as soon as the import ends."""
    import signal

    hold = hasattr(signal, "pthread_sigmask")  # not on Windows
    if hold:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import numpy  # noqa: F401
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
