"""A new user's bad inputs, as a table: each case runs the installed `kvlite` as a user would and
expects a non-zero exit (or, where the session should survive, exit 0), one `kvlite: error:` line
naming the problem, and never a traceback.

KVLITE_TEST_CMD (e.g. "python -m kvlite" with PYTHONPATH on an older checkout) runs the table on
another build of kvlite: that is how the closing note shows these cases failing before the change.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import free_port

KVLITE = [str(pathlib.Path(sys.executable).parent / "kvlite")]
CMD = shlex.split(os.environ["KVLITE_TEST_CMD"]) if os.environ.get("KVLITE_TEST_CMD") else KVLITE
# Root ignores file permissions; dropping CAP_DAC_* from the bounding set makes it obey them. Any
# other user obeys them already.
ROOT = os.geteuid() == 0
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if ROOT else []
BAD_UTF8 = b"The code is \xff\xfe 1234.\n"
CLOSE_STDOUT = ["sh", "-c", 'exec "$@" >&-', "sh"]
CLOSE_STDIN = ["sh", "-c", 'exec "$@" <&-', "sh"]


def kvlite(*args, stdin: bytes | None = None, stdout=None, wrap: list[str] | None = None, timeout: float = 120):
    """Run kvlite; args may be bytes (argv that is not UTF-8)."""
    return subprocess.run(
        [*(wrap or []), *CMD, *args],
        input=stdin,
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tempfile.gettempdir(),
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def one_error(proc, needle: str, rc: int | None = None) -> None:
    err = proc.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert proc.returncode != 0 if rc is None else proc.returncode == rc, (proc.returncode, err)
    lines = [line for line in err.strip().splitlines() if line.startswith("kvlite")]
    assert any(line.startswith("kvlite: error:") and needle in line for line in lines), err
    if rc is None:
        assert len(err.strip().splitlines()) == 1, err


@pytest.fixture
def files(tmp_path, tiny_paths):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(BAD_UTF8)
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"context": "abc \xff", "input": "q", "answers": ["a"], "dataset": "hotpotqa"}\n')
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(pathlib.Path(tiny_paths["llama"]).read_bytes())
    secret.chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    head = pathlib.Path(tiny_paths["llama"]).read_bytes()
    key = b"llama.attention.head_count"
    at = head.index(key) + len(key) + 4  # after the key, its value type: the u32 value
    head0 = tmp_path / "head0.gguf"
    head0.write_bytes(head[:at] + (0).to_bytes(4, "little") + head[at + 4 :])
    configs = {}
    for name, text in (("toml_int", b"policies = 3\n"), ("toml_str", b'budgets = ["a"]\n'), ("toml_n", b'n = "x"\n'),
                       ("toml_utf8", b"policies = ['\xff']\n")):  # fmt: skip
        (tmp_path / f"{name}.toml").write_bytes(text)
        configs[name] = str(tmp_path / f"{name}.toml")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    lines = {"null_input": {"input": None}, "object_answers": {"answers": {"a": 1}}, "int_classes": {"all_classes": 3},
             "ruler_input": {"dataset": "ruler_vt", "input": 5, "outputs": ["a"]}}  # fmt: skip
    for name, fields in lines.items():
        row = {"context": "c", "input": "q", "answers": ["a"], "dataset": "trec", **fields}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        configs[name] = str(tmp_path / f"{name}.jsonl")
    (tmp_path / "deep.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n")
    return {"bad": str(bad), "data": str(data), "secret": str(secret), "locked": str(locked / "out"),
            "a_file": str(a_file), "missing": str(tmp_path / "missing-dir"), "head0": str(head0),
            "empty": str(empty), "deep": str(tmp_path / "deep.jsonl"), "dir": str(tmp_path), **configs}  # fmt: skip


TINY = "{llama}"
CASES = {
    # name: (argv template, stdin, wrapper, needle)
    "utf8 in -f FILE": (["generate", "-m", TINY, "-f", "{bad}"], None, None, "is not valid UTF-8"),
    "utf8 on stdin": (["generate", "-m", TINY], BAD_UTF8, None, "on stdin is not valid UTF-8"),
    "utf8 in -f -": (["generate", "-m", TINY, "-f", "-"], BAD_UTF8, None, "on stdin is not valid UTF-8"),
    "utf8 in -p": (["generate", "-m", TINY, "-p", b"\xff\xfeabc"], None, None, "-p text is not valid UTF-8"),
    "unreadable model": (["info", "-m", "{secret}"], None, NO_DAC, "Permission denied"),
    "unreadable model, generate": (["generate", "-m", "{secret}", "-p", "hi"], None, NO_DAC, "Permission denied"),
    "eval --out is a file": (
        ["eval", "-m", TINY, "--out", "{a_file}", "--lengths", "300", "-n", "1"],
        None,
        None,
        "is a file",
    ),  # fmt: skip
    "eval --out unwritable": (
        ["eval", "-m", TINY, "--out", "{locked}", "--lengths", "300", "-n", "1"],
        None,
        NO_DAC,
        "cannot write to --out",
    ),  # fmt: skip
    "--temp nan": (["generate", "-m", TINY, "-p", "hi", "--temp", "nan"], None, None, "--temp must be a finite"),
    "--temp inf": (["generate", "-m", TINY, "-p", "hi", "--temp", "inf"], None, None, "--temp must be a finite"),
    "-t -2": (["generate", "-m", TINY, "-p", "hi", "-t", "-2"], None, None, "-t must be a positive"),
    "-t 0": (["generate", "-m", TINY, "-p", "hi", "-t", "0"], None, None, "-t must be a positive"),
    "eval -t -2": (["eval", "-m", TINY, "-t", "-2", "--out", "{missing}-t"], None, None, "-t must be a positive"),
    "eval chunked evict=lazy": (
        [
            "eval",
            "-m",
            TINY,
            "--tasks",
            "chat",
            "--budgets",
            "64",
            "--policies",
            "streaming(mode=chunked,evict=lazy)",
            "--out",
            "{missing}-lazy",
        ],
        None,
        None,
        "--evict lazy needs a prefill-end policy",
    ),  # fmt: skip
    "--rpc no port": (["generate", "-m", TINY, "-p", "hi", "--rpc", "localhost"], None, None, "--rpc wants HOST:PORT"),
    "--rpc nobody there": (["info", "-m", TINY, "--rpc", "127.0.0.1:1"], None, None, "no RPC server answers"),
    "-ngl -1": (["generate", "-m", TINY, "-p", "hi", "-ngl", "-1"], None, None, "must be 0 or more"),
    "eval --ruler at a length it cannot reach": (
        ["eval", "-m", TINY, "--ruler", "qa_2", "--lengths", "1024", "-n", "1", "--out", "{missing}-r"],
        None,
        None,
        "qa_2 cannot fit a sample in 992 tokens",
    ),  # fmt: skip
    "eval -ngl -1": (["eval", "-m", TINY, "-ngl", "-1", "--out", "{missing}-g"], None, None, "-ngl must be 0 or more"),
    # issue 60: a budget as a share of the prompt
    "--budget 2x": (
        ["generate", "-m", TINY, "-p", "hi", "--policy", "snapkv", "--budget", "2x"],
        None,
        None,
        "give KV cells (128) or a share of the prompt",
    ),  # fmt: skip
    "--budget 0%": (
        ["generate", "-m", TINY, "-p", "hi", "--policy", "snapkv", "--budget", "0%"],
        None,
        None,
        "a percentage in (0, 100]",
    ),  # fmt: skip
    "--budget 1% of a short prompt": (
        ["generate", "-m", TINY, "-p", "hi there", "--policy", "snapkv", "--budget", "1%"],
        None,
        None,
        "-token prompt is 1 cell: --budget 1 leaves no room",
    ),
    "chat --budget 10%": (
        ["chat", "-m", TINY, "--policy", "snapkv", "--budget", "10%"],
        b"",
        None,
        "kvlite chat needs --budget in KV cells",
    ),  # fmt: skip
    "serve --budget 10%": (
        ["serve", "-m", TINY, "--policy", "snapkv", "--budget", "10%", "--port", "{port}"],
        None,
        None,
        "kvlite serve needs --budget in KV cells",
    ),  # fmt: skip
    # issue 61: recall in a chat
    "chat --recall with knorm": (
        ["chat", "-m", TINY, "--policy", "knorm", "--budget", "64", "--recall", "8"],
        b"",
        None,
        "policy knorm captures none",
    ),  # fmt: skip
    "serve --recall with knorm": (
        ["serve", "-m", TINY, "--policy", "knorm", "--budget", "64", "--recall", "8", "--port", "{port}"],
        None,
        None,
        "policy knorm captures none",
    ),  # fmt: skip
    "chat --recall -1": (
        ["chat", "-m", TINY, "--policy", "snapkv", "--budget", "64", "--recall", "-1"],
        b"",
        None,
        "--recall must be in 0..",
    ),  # fmt: skip
    "chat --recall-store -1": (
        ["chat", "-m", TINY, "--policy", "snapkv", "--budget", "64", "--recall", "8", "--recall-store", "-1"],
        b"",
        None,
        "--recall-store must be a size in MiB",
    ),  # fmt: skip
    "serve --recall-store nan": (
        ["serve", "-m", TINY, "--policy", "snapkv", "--budget", "64", "--recall-store", "nan", "--port", "{port}"],
        None,
        None,
        "--recall-store must be a size in MiB",
    ),  # fmt: skip
    "-c 4": (["generate", "-m", TINY, "-p", "hi", "-c", "4"], None, None, "at least 256 cells"),
    "-c -1": (["generate", "-m", TINY, "-p", "hi", "-c", "-1"], None, None, "-c must be >= 0"),
    "full --mode chunked": (
        ["generate", "-m", TINY, "-p", "hi", "--mode", "chunked"],
        None,
        None,
        "--policy full keeps every cell",
    ),  # fmt: skip
    "full --budget": (
        ["generate", "-m", TINY, "-p", "hi", "--budget", "64"],
        None,
        None,
        "--policy full keeps every cell",
    ),  # fmt: skip
    "param of another policy": (
        ["generate", "-m", TINY, "-p", "hi", "--policy", "snapkv", "--budget", "64", "-T", "8"],
        None,
        None,
        "policy snapkv has no parameter lookahead (-T)",
    ),  # fmt: skip
    "--pool-kernel 4": (
        ["generate", "-m", TINY, "-p", "hi", "--policy", "snapkv", "--budget", "64", "--pool-kernel", "4"],
        None,
        None,
        "--pool-kernel must be odd",
    ),  # fmt: skip
    "not a number": (["generate", "-m", TINY, "-p", "hi", "--top-p", "x"], None, None, "invalid float value"),
    "merge a missing dir": (
        ["eval", "--merge", "{missing}", "--out", "{missing}-merged"],
        None,
        None,
        "--merge: not a directory",
    ),  # fmt: skip
    "-ctk q9": (["generate", "-m", TINY, "-p", "hi", "-ctk", "q9"], None, None, "-ctk 'q9': the cache types are"),
    "-ctv q8_0 -fa off": (
        ["generate", "-m", TINY, "-p", "hi", "-ctv", "q8_0", "-fa", "off"],
        None,
        None,
        "needs flash attention",
    ),  # fmt: skip
    "-ctk q8_0 on 16-wide heads": (
        ["generate", "-m", TINY, "-p", "hi", "-ctk", "q8_0"],
        None,
        None,
        "this model's heads are 16 wide",
    ),  # fmt: skip
    "eval --kv-types q9": (
        ["eval", "-m", TINY, "--kv-types", "f16,q9", "--out", "{missing}-kv"],
        None,
        None,
        "--kv-types 'q9': the cache types are",
    ),  # fmt: skip
    # issue 27: closed streams (sh closes them: a subprocess cannot start with fd 1 closed otherwise)
    "stdout closed, generate": (["generate", "-m", TINY, "-p", "hi"], None, CLOSE_STDOUT, "stdout is closed"),
    "stdout closed, info": (["info", "-m", TINY], None, CLOSE_STDOUT, "stdout is closed"),
    "stdin closed, generate": (["generate", "-m", TINY], None, CLOSE_STDIN, "stdin is closed"),
    "stdin closed, chat": (["chat", "-m", TINY], None, CLOSE_STDIN, "stdin is closed"),
    # issue 58: documents and saved conversations, refused before the model loads
    "chat -f not utf-8": (["chat", "-m", TINY, "-f", "{bad}"], None, None, "is not valid UTF-8 (byte 12)"),
    "chat -f missing": (["chat", "-m", TINY, "-f", "{missing}"], None, None, "cannot read file"),
    "chat -f blank": (["chat", "-m", TINY, "-f", "{empty}"], None, None, "is empty"),
    "chat --load missing": (["chat", "-m", TINY, "--load", "{missing}"], None, None, "no saved conversation"),
    "chat --load not a slot file": (["chat", "-m", TINY, "--load", "{a_file}"], None, None, "not a kvlite slot file"),
    "chat --load --policy": (
        ["chat", "-m", TINY, "--load", "{a_file}", "--policy", "snapkv"],
        None,
        None,
        "--load resumes the conversation under the policy it was saved with: drop --policy",
    ),  # fmt: skip
    # crafted headers
    "head_count 0, info": (["info", "-m", "{head0}"], None, None, "head_count is 0: it must be a positive"),
    "head_count 0, serve": (["serve", "-m", "{head0}", "--port", "{port}"], None, None, "head_count is 0"),
    # config files of the wrong type
    "toml policies = 3": (
        ["eval", "--config", "{toml_int}", "--out", "{missing}-c1"],
        None,
        None,
        "config key policies must be a list of strings, got 3",
    ),  # fmt: skip
    "toml budgets = [a]": (
        ["eval", "--config", "{toml_str}", "--out", "{missing}-c2"],
        None,
        None,
        "--budgets 'a': give KV cells (128) or a share of the prompt (2%)",
    ),  # fmt: skip
    "toml n = x": (
        ["eval", "--config", "{toml_n}", "--out", "{missing}-c3"],
        None,
        None,
        "config key n must be an integer",
    ),  # fmt: skip
    "toml not utf-8": (
        ["eval", "--config", "{toml_utf8}", "--out", "{missing}-c4"],
        None,
        None,
        "is not valid UTF-8",
    ),  # fmt: skip
    # 32-bit fields and thread counts
    "-t 100000": (["generate", "-m", TINY, "-p", "hi", "-t", "100000"], None, None, "-t must be in 1..512"),
    "-t 10**12": (["generate", "-m", TINY, "-p", "hi", "-t", str(10**12)], None, None, "-t must be in 1..512"),
    "--top-k 2**32+1": (
        ["generate", "-m", TINY, "-p", "hi", "--top-k", "4294967297", "--temp", "1"],
        None,
        None,
        "--top-k must be in 0..2147483647",
    ),  # fmt: skip
    "-c 2**31": (["generate", "-m", TINY, "-p", "hi", "-c", str(2**31)], None, None, "-c must be in 0..2147483647"),
    "-c beyond memory": (["generate", "-m", TINY, "-p", "hi", "-c", "2000000000"], None, None, "MiB of KV cache"),
    "-T 100000": (
        ["generate", "-m", TINY, "-p", "hi", "--policy", "laq", "--budget", "64", "-T", "100000"],
        None,
        None,
        "-T must be <= 1024",
    ),  # fmt: skip
    "--first-layer 999": (
        ["generate", "-m", TINY, "-p", "hi", "--policy", "knorm", "--budget", "64", "--first-layer", "999"],
        None,
        None,
        "the model has 3 layers",
    ),  # fmt: skip
    "NUL in the prompt": (["generate", "-m", TINY], b"hel\x00lo", None, "contains a NUL character"),
    # eval options that would run nothing, or something else than asked
    "eval --max-length -5": (
        ["eval", "-m", TINY, "--max-length", "-5", "--out", "{missing}-e1"],
        None,
        None,
        "--max-length must be in 0..",
    ),  # fmt: skip
    "eval --limit -1": (
        ["eval", "-m", TINY, "--data", "{data}", "--limit", "-1", "--out", "{missing}-e2"],
        None,
        None,
        "--limit must be in 0..",
    ),  # fmt: skip
    "eval --n-predict -1": (
        ["eval", "-m", TINY, "--n-predict", "-1", "--out", "{missing}-e3"],
        None,
        None,
        "--n-predict must be in 1..",
    ),  # fmt: skip
    "eval --budgets ''": (
        ["eval", "-m", TINY, "--budgets", "", "--out", "{missing}-e4"],
        None,
        None,
        "--budgets names no budget: streaming, snapkv, echokv need one",
    ),  # fmt: skip
    "eval --policies ''": (
        ["eval", "-m", TINY, "--policies", "", "--out", "{missing}-e5"],
        None,
        None,
        "--policies names no policy",
    ),  # fmt: skip
    "eval --lengths ''": (
        ["eval", "-m", TINY, "--lengths", "", "--out", "{missing}-e6"],
        None,
        None,
        "--lengths names no length",
    ),  # fmt: skip
    "eval -n 0": (["eval", "-m", TINY, "-n", "0", "--out", "{missing}-e7"], None, None, "-n 0 generates no sample"),
    "eval empty --data": (
        ["eval", "-m", TINY, "--data", "{empty}", "--out", "{missing}-e8"],
        None,
        None,
        "holds no line",
    ),  # fmt: skip
    # issue 60: what failed late (a cell at a time, a line at a time) or said something else
    "eval echokv(proposals=25)": (
        ["eval", "-m", TINY, "--policies", "full,echokv(proposals=25)", "--out", "{missing}-e10"],
        None,
        None,
        "--policies echokv(proposals=25): --proposals picks among the -T positions: at most 24, got 25",
    ),  # fmt: skip
    "eval snapkv(pool_kernel=4)": (
        ["eval", "-m", TINY, "--policies", "snapkv(pool_kernel=4)", "--out", "{missing}-e11"],
        None,
        None,
        "--pool-kernel must be odd (or 0), got 4",
    ),  # fmt: skip
    "eval echokv(P=0)": (
        ["eval", "-m", TINY, "--policies", "echokv(P=0)", "--out", "{missing}-e12"],
        None,
        None,
        "--proposals must be >= 1, got 0",
    ),  # fmt: skip
    "eval --dataset hotpot": (
        ["eval", "-m", TINY, "--data", "{null_input}", "--dataset", "hotpot", "--out", "{missing}-e13"],
        None,
        None,
        "unknown LongBench dataset 'hotpot'",
    ),  # fmt: skip
    "eval --data null input": (
        ["eval", "-m", TINY, "--data", "{null_input}", "--out", "{missing}-e14"],
        None,
        None,
        "null_input.jsonl:1: field input must be a string, got null: fix or remove them",
    ),  # fmt: skip
    "eval --data object answers": (
        ["eval", "-m", TINY, "--data", "{object_answers}", "--out", "{missing}-e15"],
        None,
        None,
        "field answers must be a string or a non-empty list of strings, got an object",
    ),  # fmt: skip
    "eval --data integer all_classes": (
        ["eval", "-m", TINY, "--data", "{int_classes}", "--out", "{missing}-e16"],
        None,
        None,
        "field all_classes must be a list of strings or null, got 3",
    ),  # fmt: skip
    "eval --data RULER integer input": (
        ["eval", "-m", TINY, "--data", "{ruler_input}", "--out", "{missing}-e17"],
        None,
        None,
        "field input must be a string, got 5",
    ),  # fmt: skip
    "eval --data nested 200000 deep": (
        ["eval", "-m", TINY, "--data", "{deep}", "--out", "{missing}-e18"],
        None,
        None,
        "deep.jsonl:1: JSON nested too deep",
    ),  # fmt: skip
    "eval --data a directory": (
        ["eval", "-m", TINY, "--data", "{dir}", "--out", "{missing}-e19"],
        None,
        None,
        "is a directory: name a JSONL file",
    ),  # fmt: skip
    "eval --data /dev/null": (
        ["eval", "-m", TINY, "--data", "/dev/null", "--out", "{missing}-e20"],
        None,
        None,
        "--data /dev/null is not a regular file",
    ),  # fmt: skip
    "eval --data bad UTF-8": (
        ["eval", "-m", TINY, "--data", "{data}", "--policies", "full", "--out", "{missing}-e21"],
        None,
        None,
        "bad.jsonl:1: not valid UTF-8",
    ),  # fmt: skip
    "eval --kv-types f16,f16": (
        ["eval", "-m", TINY, "--kv-types", "f16,f16", "--out", "{missing}-e22"],
        None,
        None,
        "--kv-types names f16 twice",
    ),  # fmt: skip
    "eval --ruler niah": (
        ["eval", "-m", TINY, "--ruler", "niah", "--out", "{missing}-e23"],
        None,
        None,
        "unknown RULER task 'niah'",
    ),  # fmt: skip
    "eval -t 100000": (
        ["eval", "-m", TINY, "-t", "100000", "--out", "{missing}-e9"],
        None,
        None,
        "-t must be in 1..512",
    ),  # fmt: skip
    # the server's own flags
    "serve --api-key ''": (["serve", "-m", TINY, "--api-key", ""], None, None, "--api-key is empty"),
    "serve --max-tokens -1": (
        ["serve", "-m", TINY, "--max-tokens", "-1"],
        None,
        None,
        "--max-tokens must be in 0..",
    ),  # fmt: skip
    "--lengths 0": (
        ["eval", "-m", TINY, "--lengths", "0", "--out", "{missing}-l0"],
        None,
        None,
        "--lengths must be in 256..",
    ),  # fmt: skip
}


def _argv(template, tiny_paths, files):
    fields = {**tiny_paths, **files, "port": free_port()}
    return [a if isinstance(a, bytes) else a.format(**fields) for a in template]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line(case, tiny_paths, files):
    template, stdin, wrap, needle = CASES[case]
    if wrap and ROOT and not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: file permissions cannot be made to apply")
    proc = kvlite(*_argv(template, tiny_paths, files), stdin=stdin, wrap=wrap)
    one_error(proc, needle)
    if template[0] == "eval":  # a refused run leaves no output folder behind
        out = _argv(template, tiny_paths, files)[template.index("--out") + 1]
        assert not pathlib.Path(out).exists() or out == files["a_file"]


def test_stdout_on_a_full_disk(tiny_paths):
    with open("/dev/full", "wb") as full:
        proc = kvlite("info", "-m", tiny_paths["llama"], "--json", stdout=full)
    one_error(proc, "No space left on device")


def test_chat_survives_a_bad_line(tiny_paths):
    proc = kvlite("chat", "-m", tiny_paths["llama"], "-n", "4", stdin=b"hello\n" + BAD_UTF8 + b"again\n")
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert err.count("not valid UTF-8") == 1
    assert err.count("| cells") == 2  # both good lines were answered


def test_chat_refuses_a_nul_in_a_line(tiny_paths):
    """llama.cpp's template engine reads C strings: a NUL would cut the message short silently."""
    proc = kvlite("chat", "-m", tiny_paths["llama"], "-n", "4", stdin=b"hello\nhel\x00lo\nagain\n")
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert err.count("contains a NUL character") == 1 and err.count("| cells") == 2, err


# A traceback frame in kvlite's own code. Not any path with a kvlite folder: a clone named kvlite
# holds the .venv whose files CPython's startup runs.
KVLITE_FRAME = re.compile(r'File "[^"]*[/\\]kvlite[/\\](?:\w+[/\\])*\w+\.py"')


# From 0 s (CPython still starting: the signal ends it as SIGINT does) through the imports to the
# generation. kvlite's handler is in place from its first import on; what precedes that is CPython's
# own startup (site, then finding the kvlite package), a few milliseconds in which CPython itself
# reports the KeyboardInterrupt, with no line of kvlite's run yet: that is accepted, nothing later.
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8])
def test_ctrl_c_at_any_moment_of_startup(tiny_paths, delay):
    # As in a terminal: SIGINT not ignored in the child, whatever pytest inherited (a shell's
    # background job has it ignored, and the signal would then be lost before kvlite's handler).
    # A handler in the parent becomes the default across exec; a preexec_fn would slow the start.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*CMD, "generate", "-m", tiny_paths["llama"], "-p", "hello " * 200, "-n", "3000"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tempfile.gettempdir())  # fmt: skip
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(delay)
    finished_first = proc.poll() is not None  # a fast machine may be done before the signal
    if not finished_first:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    if "KeyboardInterrupt" in err and not KVLITE_FRAME.search(err) and proc.returncode != 0:
        return  # CPython's own startup was interrupted, before kvlite's first line
    assert "Traceback" not in err, err
    # Before Python has installed its handler (or after main returned) the signal ends the process
    # as SIGINT does, silently; in between it is one line and status 130.
    assert proc.returncode in ((0,) if finished_first else (130, -signal.SIGINT)), (proc.returncode, err)
    if proc.returncode == 130:
        assert err.strip().splitlines()[-1] == "kvlite: interrupted", err


def test_ctrl_c_in_a_callback_python_cannot_raise_from_ends_the_run():
    # Where a Ctrl-C at 0.2 s once landed: a weakref callback of the import system's module locks.
    # Python prints such an exception as ignored and goes on; kvlite ends the run as for any Ctrl-C.
    code = """if True:
        import sys, weakref
        from kvlite import cli

        class Lock: pass

        def run(argv):
            lock = Lock()
            ref = weakref.ref(lock, lambda _: (_ for _ in ()).throw(KeyboardInterrupt))
            print("before", flush=True)
            del lock
            print("went on")
            return 0

        cli._main = run
        sys.exit(cli.main([]))
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (130, "before\n"), proc
    assert "Traceback" not in proc.stderr and proc.stderr.strip() == "kvlite: interrupted", proc.stderr


def test_ctrl_c_inside_numpys_c_initialisation_is_one_line():
    # Where a Ctrl-C once landed in CI: numpy's C code imports `datetime` through the C API, which
    # turned the KeyboardInterrupt into an ImportError and a traceback. The signal is sent from the
    # import of `datetime` itself, so the moment is exact on any machine.
    code = """if True:
        import os, signal, sys
        from kvlite import cli

        class Finder:
            def find_spec(self, name, path=None, target=None):
                if name == "datetime":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        assert "numpy" not in sys.modules and "datetime" not in sys.modules
        sys.meta_path.insert(0, Finder())
        sys.exit(cli.main(["--help"]))  # the parser imports the policies, and they numpy
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr and proc.stderr.strip() == "kvlite: interrupted", proc.stderr
    assert (proc.returncode, proc.stdout) == (130, ""), proc


def test_a_ctrl_c_inside_a_contexts_making_leaves_nothing_to_print(tiny_model, monkeypatch):
    # The moment between llama.cpp's context and the batch kvlite makes for it (microseconds, at
    # a model load): the half-made context is freed without an ignored traceback.
    import gc

    import kvlite.engine.context as context

    def interrupted(_kind):
        raise KeyboardInterrupt

    monkeypatch.setattr(context, "logged_buffers", interrupted)
    unraised = []
    monkeypatch.setattr(sys, "unraisablehook", unraised.append)
    with contextlib.suppress(KeyboardInterrupt):
        context.Context(tiny_model, n_ctx=128, n_batch=32)
    gc.collect()
    assert [u.exc_value for u in unraised] == []


def test_prompt_longer_than_context_hint_works(tiny_paths):
    """The suggested command fits the context it was suggested for."""
    proc = kvlite("generate", "-m", tiny_paths["llama"], "-p", "x" * 700, "-c", "256")
    one_error(proc, "raise -c or use an evicting policy")
    hint = proc.stderr.decode().split("(e.g. ")[1].rstrip(")\n").split()
    ok = kvlite("generate", "-m", tiny_paths["llama"], "-p", "x" * 700, "-c", "256", "-n", "4", *hint)
    assert ok.returncode == 0, ok.stderr.decode()


def test_odd_context_is_noted(tiny_paths):
    proc = kvlite("generate", "-m", tiny_paths["llama"], "-p", "hi", "-c", "300", "-n", "2", "--json")
    assert proc.returncode == 0
    assert "rounds -c 300 up to 512" in proc.stderr.decode()


def test_closed_stdout_and_stderr_leave_nothing_in_the_wrong_place(tiny_paths, tmp_path):
    """eval with stdout closed still writes its records; generate with stderr closed writes the text
    alone to stdout (Python would print the summary there, and the next file opened would take the
    closed descriptor)."""
    proc = kvlite("eval", "-m", tiny_paths["llama"], "--lengths", "256", "-n", "1", "--tasks", "single",
                  "--policies", "full", "--out", str(tmp_path / "o"), "--no-plots", wrap=CLOSE_STDOUT)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr.decode(), proc.stderr.decode()
    assert (tmp_path / "o" / "samples.jsonl").read_text().count("\n") == 1
    proc = kvlite(
        "generate", "-m", tiny_paths["llama"], "-p", "hi", "-n", "3", wrap=["sh", "-c", 'exec "$@" 2>&-', "sh"]
    )
    assert proc.returncode == 0 and b"[kvlite]" not in proc.stdout and proc.stderr == b"", proc


def test_a_resume_skips_lines_that_are_not_records(tiny_paths, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "samples.jsonl").write_text('{"note": 1}\n[1, 2]\n')
    proc = kvlite("eval", "-m", tiny_paths["llama"], "--lengths", "256", "-n", "1", "--tasks", "single",
                  "--policies", "full", "--out", str(out), "--no-plots")  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "2 line(s) are not records of a grid, skipped" in err


def test_merge_keeps_the_records_out_already_holds(tiny_paths, tmp_path):
    """Merging one shard into a directory that holds a whole run adds, and never loses a record."""
    run = ["-m", tiny_paths["llama"], "--lengths", "256", "-n", "2", "--tasks", "single", "--policies", "full",
           "--no-plots"]  # fmt: skip
    assert kvlite("eval", *run, "--out", str(tmp_path / "all")).returncode == 0
    assert kvlite("eval", *run, "--shard", "1/2", "--out", str(tmp_path / "s1")).returncode == 0
    proc = kvlite("eval", "--merge", str(tmp_path / "s1"), "--out", str(tmp_path / "all"), "--no-plots")
    assert proc.returncode == 0 and "held 2 records, now 2" in proc.stderr.decode(), proc.stderr.decode()
