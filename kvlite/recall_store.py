"""Where the evicted cells kept for recall live (KVCache(keep_evicted=True)): in host memory while
every store in this process fits the cap (`--recall-store MiB`), and beyond it in a file under
kvlite's cache folder, mapped read-only so the OS pages it in and out (kvstate.mapped). The cap
is the process's, not a conversation's: a server's conversations share it."""

from __future__ import annotations

import itertools
import math
import os
import threading
import weakref

from .engine import kvstate
from .errors import KvliteError
from .evict import RECALL_STORE_SHARE
from .models import cache_dir

_cap: int | None = None  # bytes; None: RECALL_STORE_SHARE of the available memory, read on first use
_in_ram: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a store held in memory
_on_disk: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a store in a mapped file
_names = itertools.count()
_lock = threading.Lock()  # a server's conversations keep and count stores from their own threads


def set_cap(mib: float | None) -> None:
    """The most host memory (MiB) the stores of this process hold before they go to disk; None:
    RECALL_STORE_SHARE of the memory available then. 0 sends every store to disk."""
    global _cap
    if mib is not None and not (math.isfinite(mib) and mib >= 0):
        raise KvliteError(f"--recall-store must be a size in MiB, 0 or more (got {mib})")
    _cap = None if mib is None else int(mib * 2**20)


def cap() -> int:
    global _cap
    if _cap is None:
        _cap = int(RECALL_STORE_SHARE * available_memory())
    return _cap


def available_memory() -> int:
    """MemAvailable (Linux), else free physical memory where the OS tells it, else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30


def keep(state: kvstate.SeqState | None, replacing: kvstate.SeqState | None = None) -> kvstate.SeqState | None:
    """`state` as a conversation's store, in memory if this process's stores fit the cap with it
    (less the store it replaces), else in a file. Layers are read one at a time either way, so a
    store on disk is rewritten without being held in memory whole."""
    if state is None:
        return None
    size = kvstate.nbytes(state)
    others = ram_bytes() - (kvstate.nbytes(replacing) if replacing is not None and in_ram(replacing) else 0)
    if others + size <= cap():
        kept = kvstate.held(state)
        where = _in_ram
    else:
        folder = cache_dir() / "recall"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KvliteError(f"cannot keep evicted cells in {folder}: {e.strerror or e} (set KVLITE_CACHE to a "
                              "folder kvlite may write, or give --recall-store more memory)") from None  # fmt: skip
        kept = kvstate.mapped(state, folder / f"store-{os.getpid()}-{next(_names)}.kv")
        where = _on_disk
    with _lock:
        where[id(kept)] = kept
    return kept


def in_ram(state: kvstate.SeqState | None) -> bool:
    with _lock:
        return state is not None and _in_ram.get(id(state)) is state


def ram_bytes() -> int:
    """Host memory the stores of this process hold (a store shared by a parked snapshot once)."""
    with _lock:
        stores = list(_in_ram.values())
    return sum(kvstate.nbytes(s) for s in stores)


def disk_bytes() -> int:
    with _lock:
        stores = list(_on_disk.values())
    return sum(kvstate.nbytes(s) for s in stores)
