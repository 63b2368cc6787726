"""Records on disk: one JSON line per finished cell, appended whole and flushed; a partial last line
(a kill mid-write) is dropped before a run resumes; summaries are written whole or not at all."""

from __future__ import annotations

import gzip
import json
import pathlib

from ..errors import KvliteError


def record_key(r: dict) -> tuple:
    return (r["model"], r["task"], r["sample"], r["policy"], r["budget"])


def read_records(out: pathlib.Path, pattern: str = "samples*.jsonl") -> list[dict]:
    """Every record in a directory's sample files (a truncated last line, from a kill, is skipped)."""
    records: dict[tuple, dict] = {}
    # A finished stage's records may be stored gzipped (results-runs/ keeps large files small).
    for path in sorted(out.glob(pattern)) + sorted(out.glob(pattern + ".gz")):
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        for line in text.splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[record_key(r)] = r
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
