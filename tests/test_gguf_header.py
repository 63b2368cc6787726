"""The GGUF header reader is total: any byte string gives a KvliteError naming what is wrong, or a
header and model facts in range. Mutated headers of the tiny fixtures and the real models are the
input: bytes overwritten with the values that break readers (0, 2^31, 2^63, 2^64 - 1, ...), most
of them on the header's own counts, lengths and types (where a mutation is found by walking the
header), truncations, and insertions. The file keeps its size (a sparse copy), so the mutated
metadata is read, not refused as truncated.

KVLITE_HEADER_EXAMPLES=10000 .venv/bin/pytest tests/test_gguf_header.py runs the long version
(the closing note of issue 27 reports it); CI runs 150 examples."""

from __future__ import annotations

import os
import pathlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlite import gguf_header
from kvlite.errors import KvliteError
from kvlite.models import read_model_info

EXAMPLES = int(os.environ.get("KVLITE_HEADER_EXAMPLES", "150"))
NASTY = [0, 1, 2, 3, 7, 8, 9, 64, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1]


def _fields(path: str) -> tuple[bytes, int, list[tuple[int, str]]]:
    """The header's bytes (to the start of the tensor data), the file's size, and where each of the
    header's fields lies: (offset, struct format), found by reading it with a recording reader."""
    seen: list[tuple[int, str]] = []
    plain = gguf_header._File.unpack

    def recording(self, fmt):
        seen.append((self.f.tell(), fmt))
        return plain(self, fmt)

    gguf_header._File.unpack = recording
    try:
        header = gguf_header.read_header(path)
    finally:
        gguf_header._File.unpack = plain
    with open(path, "rb") as f:
        head = f.read(header.data_start)
    return head, os.path.getsize(path), seen


@pytest.fixture(scope="module")
def headers(tiny_paths) -> list[tuple[bytes, int, list[tuple[int, str]]]]:
    from kvlite.models import default_model_path

    paths = [tiny_paths[name] for name in ("llama", "llama3", "qwen2", "gemma3")] + [str(default_model_path())]
    return [_fields(p) for p in paths]


def _mutate(data, head: bytes, size: int, fields: list[tuple[int, str]]) -> tuple[bytes, int]:
    b = bytearray(head)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        kind = data.draw(st.sampled_from(["field", "field", "field", "byte", "truncate", "insert"]), label="kind")
        if kind == "field":
            offset, fmt = data.draw(st.sampled_from(fields), label="field")
            width = struct.calcsize(fmt)
            value = data.draw(st.sampled_from(NASTY), label="value") % (1 << (8 * width))
            b[offset : offset + width] = value.to_bytes(width, "little")
        elif kind == "byte":
            i = data.draw(st.integers(0, len(b) - 1), label="at")
            b[i] = data.draw(st.integers(0, 255), label="byte")
        elif kind == "truncate":
            cut = data.draw(st.integers(0, len(b)), label="cut")
            return bytes(b[:cut]), cut
        else:
            i = data.draw(st.integers(0, len(b)), label="at")
            b[i:i] = data.draw(st.binary(min_size=1, max_size=16), label="inserted")
    return bytes(b), size


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_any_mutated_header_is_a_header_or_one_error(headers, data, tmp_path_factory):
    head, size, fields = data.draw(st.sampled_from(headers), label="model")
    raw, size = _mutate(data, head, size, fields)
    path = tmp_path_factory.mktemp("mutant") / "m.gguf"
    with open(path, "wb") as f:
        f.write(raw)
        f.truncate(max(size, len(raw)))  # sparse: the tensor data reads as zeros
    try:
        info = read_model_info(path)
    except KvliteError as e:
        assert "\n" not in str(e) and str(e)
        return
    finally:
        pathlib.Path(path).unlink()
    assert 0 < info.n_layer < 2**31 and 0 < info.n_head_kv <= info.n_head and info.head_dim > 0


def test_the_crafted_headers_of_issue_27(tiny_paths, tmp_path):
    """Alignment 0, a head count of 0, a string of 2^63 bytes: each one line, no traceback."""
    head, size, fields = _fields(tiny_paths["llama"])

    def with_value(key: str, fmt: str, value: int) -> pathlib.Path:
        at = head.index(key.encode()) + len(key) + 4  # the key, then its value type (u32)
        b = bytearray(head)
        b[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
        path = tmp_path / f"{key}-{value}.gguf"
        with open(path, "wb") as f:
            f.write(b)
            f.truncate(size)
        return path

    n_head = with_value("llama.attention.head_count", "<I", 0)
    with pytest.raises(KvliteError, match="head_count is 0: it must be a positive"):
        read_model_info(n_head)
    crafted = tmp_path / "newline.gguf"  # a value quoted in a message stays on its one line
    with open(crafted, "wb") as f:
        f.write(head.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00ll\nma", 1))
        f.truncate(size)
    with pytest.raises(KvliteError, match=r"unsupported architecture 'll\\nma'") as e:
        read_model_info(crafted)
    assert "\n" not in str(e.value)
    long_name = with_value("general.architecture", "<Q", 2**63)  # a string value's length
    with pytest.raises(KvliteError, match="ends inside the GGUF header"):
        read_model_info(long_name)
    # alignment: the fixture has none, so add the key (u32 value type 4) as one more metadata pair
    count_at = 4 + 4 + 8  # magic, version, n_tensors: then n_kv
    n_kv = struct.unpack_from("<Q", head, count_at)[0]
    first_key = count_at + 8
    pair = struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, 0)
    b = bytearray(head)
    b[count_at : count_at + 8] = struct.pack("<Q", n_kv + 1)
    b[first_key:first_key] = pair
    path = tmp_path / "align0.gguf"
    path.write_bytes(bytes(b))
    with pytest.raises(KvliteError, match="general.alignment 0 is not a power of two"):
        read_model_info(path)
