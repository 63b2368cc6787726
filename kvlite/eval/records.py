"""Records on disk: one JSON line per finished cell, appended whole and flushed; a partial last line
(a kill mid-write) is dropped before a run resumes; summaries are written whole or not at all."""

from __future__ import annotations

import gzip
import json
import pathlib
import sys

from ..errors import KvliteError


def record_key(r: dict) -> tuple:
    return (r["model"], r["task"], r["sample"], r["policy"], r["budget"])


def is_record(r: object) -> bool:
    """A line a grid wrote: an object with the fields of its key (a hand-edited or foreign line is not)."""
    if not isinstance(r, dict):
        return False
    key = (r.get("model"), r.get("task"), r.get("sample"), r.get("policy"))
    return all(isinstance(v, str) for v in key[:2] + key[3:]) and isinstance(key[2], (int, str)) and (
        r.get("budget") is None or isinstance(r.get("budget"), (int, str))) and "budget" in r  # fmt: skip


def read_records(out: pathlib.Path, pattern: str = "samples*.jsonl") -> list[dict]:
    """Every record in a directory's sample files. A truncated last line (from a kill) is skipped;
    other lines that are not records are skipped and named on stderr, so that a resume or a
    summary never stops on them and never counts them."""
    records: dict[tuple, dict] = {}
    # A stage's records may be stored gzipped (results-runs/ keeps large files small), and a run
    # resumed from them appends to the plain file: read the .gz first, so records keep one order
    # (tables list policies as first met) whether or not the new lines were gzipped since.
    for path in sorted(out.glob(pattern + ".gz")) + sorted(out.glob(pattern)):
        data = path.read_bytes()
        text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode(errors="replace")
        lines = text.splitlines()
        foreign = 0
        for i, line in enumerate(lines):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                foreign += i < len(lines) - 1 and bool(line.strip())  # a cut last line is a kill's, not news
                continue
            if not is_record(r):
                foreign += 1
                continue
            records[record_key(r)] = r
        if foreign:
            print(f"kvlite eval: {path}: {foreign} line(s) are not records of a grid, skipped", file=sys.stderr)
    return list(records.values())


def prepare_out(out: pathlib.Path) -> None:
    """Create the output directory and make sure records can be written there, before any work."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvlite-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise KvliteError(f"cannot write to --out {out}: {e.strerror or e}") from None


def repair_tail(path: pathlib.Path) -> bool:
    """Drop a partial last line (a write cut by a kill or a full disk). True if one was dropped."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb+") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return False
        data = path.read_bytes()
        f.truncate(data.rfind(b"\n") + 1)
    return True


def write_atomic(path: pathlib.Path, text: str) -> None:
    """Write a whole file or nothing: a temporary file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KvliteError(f"cannot write {path}: {e.strerror or e}") from None
