"""The CLI as a user runs it: the installed `kvlite` script in a subprocess."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import free_port, run_cli

from kvlite.reference.tiny_gguf import TinySpec, write_tiny_gguf


def assert_one_line_error(proc, needle: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvlite: error:") and needle in lines[0], lines[0]


def test_info_json_on_tiny_model(tiny_paths):
    proc = run_cli("info", "-m", tiny_paths["qwen2"], "--json")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["arch"] == "qwen2" and facts["rope_type"] == "neox"
    assert (facts["n_layer"], facts["n_head"], facts["n_head_kv"], facts["head_dim"]) == (2, 4, 1, 32)
    assert "streaming" in facts["policies"]
    # The backend llama.cpp was built with, and the devices ggml enumerates (this machine: CPU only).
    assert facts["gpu_offload"] == any(d["type"] in ("gpu", "igpu") for d in facts["devices"])
    assert any(d["type"] == "cpu" and d["total_mib"] > 0 for d in facts["devices"])
    assert "CPU" in facts["system_info"]
    assert facts["kernels_on"] == "cpu" or facts["gpu_offload"]
    assert facts["rpc"]  # setup.sh builds llama.cpp with RPC, which the offload tests use


def test_info_says_what_each_policy_scores_on_each_architecture(tiny_path):
    from kvlite.models import ARCHS
    from kvlite.policies import POLICIES

    proc = run_cli("info", "-m", tiny_path, "--json")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["supported_archs"] == list(ARCHS) and facts["arch"] in ARCHS
    assert facts["qk_norm"] == ARCHS[facts["arch"]].qk_norm
    assert sorted(facts["scores_on"]) == sorted(POLICIES)
    if facts["swa_layers"]:  # gemma3: the layers that see every cell
        assert f"the {facts['n_layer'] - len(facts['swa_layers'])} global layers" in facts["scores_on"]["snapkv"]
        assert facts["scores_on"]["cc"].startswith("not available on gemma3")
    else:
        assert f"all {facts['n_layer']} layers" in facts["scores_on"]["snapkv"]
    text = run_cli("info", "-m", tiny_path).stdout  # the same facts for a person: one policy a line
    assert any(line.strip().startswith("kvzip: the attention of repeat-the-context") for line in text.splitlines())


def test_ngl_on_this_build(tiny_paths):
    """-ngl keeps llama.cpp's meaning; on a CPU build nothing is offloaded and a note says why."""
    from kvlite.native import default_device

    proc = run_cli("info", "-m", tiny_paths["qwen2"], "--json", "-ngl", "1")
    assert proc.returncode == 0, proc.stderr
    gpu = default_device() != "cpu"
    assert json.loads(proc.stdout)["n_gpu_layers"] == (1 if gpu else 0)
    proc = run_cli("generate", "-m", tiny_paths["qwen2"], "-p", "abc", "-n", "2", "-ngl", "99", "--json")
    assert proc.returncode == 0, proc.stderr
    assert ("-ngl is ignored" in proc.stderr) != gpu


def test_generate_json_tiny_streaming(tiny_paths):
    prompt = "abcdefghij" * 60  # 600 byte-level tokens
    proc = run_cli("generate", "-m", tiny_paths["llama"], "-p", prompt, "-n", "12", "--json",
                   "--policy", "streaming", "--budget", "100", "--sinks", "4", "--chunk", "64")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    cache = out["cache"]
    assert out["prompt_tokens"] >= 600 and out["generated_tokens"] <= 12
    assert cache["budget"] == 100 and cache["max_cells"] <= 100 + 64
    n = out["prompt_tokens"]
    assert cache["kept_positions"] == [0, 1, 2, 3] + list(range(n - 96, n))
    assert cache["evicted"] >= n - 100
    assert set(out["timings"]) >= {"prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s"}


def test_generate_budget_as_a_share_of_the_prompt(tiny_paths):
    """--budget 25%: StreamingLLM keeps its 4 sinks and the last quarter-minus-4 positions."""
    proc = run_cli("generate", "-m", tiny_paths["llama"], "-p", "abcdefghij" * 60, "-n", "2", "--json",
                   "--policy", "streaming", "--budget", "25%")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    n, cache = out["prompt_tokens"], out["cache"]
    assert (cache["budget"], cache["budget_share"]) == (n // 4, "25%")
    assert cache["kept_positions"] == [0, 1, 2, 3] + list(range(n - (n // 4 - 4), n))


def test_default_threads_are_the_cores_kvlite_may_run_on():
    """taskset or a container's cpuset limits the cores: -t's default follows (os.cpu_count would
    put 8 threads on one core)."""
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    code += "from kvlite.native import default_threads; print(default_threads())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


def test_generate_reads_file_and_stdin(tiny_paths, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("hello world")
    a = run_cli("generate", "-m", tiny_paths["llama"], "-f", str(f), "-n", "4", "--json")
    b = run_cli("generate", "-m", tiny_paths["llama"], "-n", "4", "--json", stdin="hello world")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]


@pytest.mark.slow
@pytest.mark.model_answer
def test_generate_default_model_answers():
    proc = run_cli("generate", "--chat", "-p", "What is the capital of France?", "-n", "24", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["cache"]["evicted"] == 0 and out["cache"]["budget"] is None


@pytest.mark.slow
@pytest.mark.model_answer
def test_generate_default_model_streams_text():
    proc = run_cli("generate", "-p", "The capital of France is", "-n", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "[kvlite] prompt" in proc.stderr


@pytest.mark.slow
@pytest.mark.model_answer
def test_chat_scripted_stdin_default_model():
    script = "What is the capital of France?\n/stats\n/reset\nName a color.\n"
    proc = run_cli("chat", "-n", "24", stdin=script)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "[conversation cleared]" in proc.stderr
    assert proc.stderr.count("| cells") >= 3  # two status lines and /stats


@pytest.mark.slow
def test_chat_streaming_budget_holds_across_turns():
    long_turn = "Tell me about the history of the city of Paris and its bridges. " * 12
    script = f"{long_turn}\n{long_turn}\nWhat did I ask about?\n/stats\n"
    proc = run_cli("chat", "-n", "32", "--policy", "streaming", "--budget", "160", "--chunk", "96",
                   stdin=script)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    status = [ln for ln in proc.stderr.splitlines() if ln.startswith("[eager | cells")]
    assert len(status) == 4
    for ln in status:
        cells = int(ln.split("cells ")[1].split("/")[0])
        assert cells <= 160
    assert "evicted 0" not in status[-1]


# -- bad input: one line on stderr, non-zero exit ------------------------------------------------


def test_missing_model_file(tmp_path):
    assert_one_line_error(run_cli("info", "-m", str(tmp_path / "nope.gguf")), "not found")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_text("this is not a model\n" * 10)
    assert_one_line_error(run_cli("generate", "-m", str(f), "-p", "hi"), "not a GGUF")


@pytest.mark.parametrize("keep_fraction", [0.5, 0.0005])  # cut in the data, cut in the header
def test_truncated_gguf(tiny_paths, tmp_path, keep_fraction):
    data = pathlib.Path(tiny_paths["llama"]).read_bytes()
    f = tmp_path / "cut.gguf"
    f.write_bytes(data[: max(8, int(len(data) * keep_fraction))])
    assert_one_line_error(run_cli("generate", "-m", str(f), "-p", "hi"), "truncated")


def _header_only_gguf(path: pathlib.Path, arch: str, tensors: dict | None = None) -> pathlib.Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, value in (tensors or {"token_embd.weight": np.zeros((4, 8), np.float32)}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("command", [["info"], ["generate", "-p", "hi"], ["chat"], ["eval", "--tasks", "single"],
                                     ["serve"]])  # fmt: skip
def test_recurrent_architecture_is_refused_everywhere(tmp_path, command):
    """llama.cpp cannot remove part of a recurrent memory: every command says so in one line and
    names what kvlite supports."""
    path = _header_only_gguf(tmp_path / "mamba.gguf", "mamba")
    port = ["--port", str(free_port())] if command == ["serve"] else []
    proc = run_cli(command[0], "-m", str(path), *command[1:], *port, stdin="hi\n", timeout=60)
    assert_one_line_error(proc, "'mamba', a recurrent or hybrid model")
    assert "kvlite supports llama, qwen2, qwen3" in proc.stderr


def test_unknown_architecture_and_fused_qkv_are_refused(tmp_path):
    import numpy as np

    path = _header_only_gguf(tmp_path / "bert.gguf", "bert")
    assert_one_line_error(run_cli("info", "-m", str(path)), "unsupported architecture 'bert'")
    fused = {"blk.0.attn_qkv.weight": np.zeros((24, 8), np.float32)}
    path = _header_only_gguf(tmp_path / "fused.gguf", "llama", fused)
    assert_one_line_error(run_cli("info", "-m", str(path)), "stores Q, K and V fused")


def test_budget_at_or_below_sinks(tiny_paths):
    proc = run_cli("generate", "-m", tiny_paths["llama"], "-p", "hi", "--policy", "streaming",
                   "--budget", "4", "--sinks", "4")  # fmt: skip
    assert_one_line_error(proc, "--budget 4")


def test_budget_larger_than_context(tiny_paths):
    proc = run_cli("generate", "-m", tiny_paths["llama"], "-p", "hi", "--policy", "streaming",
                   "--budget", "600", "-c", "512")  # fmt: skip
    assert_one_line_error(proc, "does not fit in the context")


def test_prompt_longer_than_context_with_full_cache(tiny_paths):
    proc = run_cli("generate", "-m", tiny_paths["llama"], "-p", "x" * 700, "-c", "256")
    assert_one_line_error(proc, "raise -c or use an evicting policy")


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(tiny_paths, prompt):
    assert_one_line_error(run_cli("generate", "-m", tiny_paths["llama"], "-p", prompt), "empty")


def test_policy_without_budget(tiny_paths):
    proc = run_cli("generate", "-m", tiny_paths["llama"], "-p", "hi", "--policy", "streaming")
    assert_one_line_error(proc, "needs --budget")


def test_chat_without_template(tiny_paths):
    assert_one_line_error(run_cli("chat", "-m", tiny_paths["qwen2"], stdin="hi\n"), "no chat template")


def test_quantized_cache_flags(tmp_path):
    """-ctk/-ctv/-fa as llama.cpp spells them: a q8_0 cache takes 34 bytes for every 32 values an
    f16 one stores in 64, evicting multiplies the saving, and what llama.cpp cannot run is one line."""
    from kvlite.reference.tiny_gguf import TinySpec, write_tiny_gguf

    path = str(write_tiny_gguf(tmp_path / "wide.gguf", TinySpec(n_layer=2, n_head=4, n_head_kv=2, head_dim=64)))
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    cache = {}
    for kv_type, policy in (("f16", []), ("q8_0", []), ("q8_0", ["--policy", "echokv", "--budget", "40"])):
        proc = run_cli("generate", "-m", path, "-p", prompt, "-n", "4", "--json", "-ctk", kv_type, "-ctv", kv_type,
                       *policy)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        cache[kv_type, bool(policy)] = json.loads(proc.stdout)["cache"]
    assert cache["q8_0", False]["type_k"] == cache["q8_0", False]["type_v"] == "q8_0"
    full, q8, q8_evicted = (cache[k]["kv_bytes"] for k in (("f16", False), ("q8_0", False), ("q8_0", True)))
    assert q8 * 64 == full * 34
    assert q8_evicted * cache["q8_0", False]["final_cells"] == q8 * cache["q8_0", True]["final_cells"]
    for flags, words in ((["-ctv", "q8_0", "-fa", "off"], "needs flash attention"),
                         (["-ctk", "q3_k"], "cache types are f32, f16, bf16, q8_0"),
                         (["-fa", "sometimes"], "use on, off or auto")):  # fmt: skip
        proc = run_cli("generate", "-m", path, "-p", "hi", "-n", "1", *flags)
        assert proc.returncode == 1 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_budget_under_the_measured_floor_gets_a_note(tiny_paths):
    """Under 64 cells no policy kept most answers on the test split: the CLI says so, and runs."""
    args = ("generate", "-m", tiny_paths["llama"], "-p", "a b c d e f g h", "-n", "2", "--json")
    small = run_cli(*args, "--policy", "knorm", "--budget", "16")
    assert small.returncode == 0 and "note: below 64 cells" in small.stderr
    enough = run_cli(*args, "--policy", "knorm", "--budget", "64")
    assert enough.returncode == 0 and "note: below" not in enough.stderr
    chunked = run_cli(*args, "--policy", "streaming", "--cache", "16")  # a fixed memory, not an answer
    assert chunked.returncode == 0 and "note: below" not in chunked.stderr


def test_a_note_once_positions_pass_the_trained_length(tmp_path):
    """The note counts positions decoded, not cells: a context roomier than the trained length says
    nothing while the prompt stays within it; a chunked cache of 100 cells on a 600-token prompt
    passes it, and says so once."""
    path = str(write_tiny_gguf(tmp_path / "short.gguf", TinySpec(n_ctx_train=256)))
    within = run_cli("generate", "-m", path, "-p", "abcdefghij" * 5, "-n", "2", "-c", "1024")
    assert within.returncode == 0 and "trained on" not in within.stderr, within.stderr
    past = run_cli("generate", "-m", path, "-p", "abcdefghij" * 60, "-n", "2", "--policy", "streaming",
                   "--cache", "100", "--chunk", "64")  # fmt: skip
    assert past.returncode == 0, past.stderr
    notes = re.findall(r"note: position \d+ is beyond the 256 positions short.gguf was trained on", past.stderr)
    assert len(notes) == 1, past.stderr
