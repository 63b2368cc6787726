"""The GPU code paths without a GPU: llama.cpp offloads the tiny model's layers, and so its KV cache,
to a ggml RPC server on this machine (scripts/rpc_server.py, the CPU backend behind a socket), a
buffer that is not host memory, as on CUDA or Metal. Everything kvlite reads then crosses ggml's
backend API: the state export an eviction scores from, the eval-callback capture of queries and
hidden states, compaction's reload, and kvlite's own kernels, which run on the RPC device.

The server computes with the same CPU code as a local run, so the results must be identical."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import free_port, run_cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT = "abcdefghij" * 60  # 600 byte-level tokens


@pytest.fixture(scope="module")
def rpc_endpoint():
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "rpc_server.py"), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"the RPC server did not start: {server.stderr.read().decode(errors='replace')}")
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    server.kill()
    server.wait()


def test_info_sees_the_rpc_device(rpc_endpoint, tiny_paths):
    proc = run_cli("info", "-m", tiny_paths["llama"], "--json", "--rpc", rpc_endpoint)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    rpc = [d for d in facts["devices"] if d["description"] == rpc_endpoint]
    assert len(rpc) == 1 and rpc[0]["type"] == "gpu", facts["devices"]
    assert facts["gpu_offload"] and facts["kernels_on"] == rpc[0]["name"]
    assert facts["n_gpu_layers"] == facts["n_layer"] + 1  # every layer and the output layer, as -ngl 99


@pytest.mark.parametrize(
    "policy",
    [
        ["snapkv", "--budget", "100"],  # scores from keys read through the state export
        ["echokv", "--budget", "100", "-T", "4", "--workspace", "200"],  # lookahead: captured queries, workspace seq
        ["kvzip", "--budget", "100"],  # reconstruction passes: captured queries and keys
        ["cc-fast", "--budget", "100"],  # hidden states captured from device tensors
        ["streaming", "--cache", "96", "--chunk", "32"],  # chunked: evict and compact (state reload) every 32
    ],
    ids=lambda p: p[0],
)
def test_offloaded_cache_gives_the_local_result(rpc_endpoint, tiny_paths, policy):
    args = ["generate", "-m", tiny_paths["llama"], "-p", PROMPT, "-n", "8", "--json", "--policy", *policy]
    local = run_cli(*args)
    offloaded = run_cli(*args, "--rpc", rpc_endpoint, "-ngl", "99")
    assert local.returncode == 0 and offloaded.returncode == 0, local.stderr + offloaded.stderr
    a, b = json.loads(local.stdout), json.loads(offloaded.stdout)
    assert list(a["cache"]["kv_buffers"]) == ["CPU"]
    assert list(b["cache"]["kv_buffers"]) == [f"RPC0[{rpc_endpoint}]"]  # the cache is not in host memory
    assert b["text"] == a["text"]
    assert b["cache"]["kept_positions"] == a["cache"]["kept_positions"]
    assert b["cache"]["final_cells"] == a["cache"]["final_cells"]


# The backend tests (pytest -m backend: twin parity of the pooled and counter-causal scores,
# resident positions against llama.cpp's exported state after evictions and compaction, the
# kernels' torch twins) of these modules, run in a pytest of their own with KVLITE_TEST_RPC set
# (conftest.py), so every model of that session is offloaded. A subset, for CI's time, of what the
# GPU checks (scripts/gpu_check.sh, vulkan_check.sh) run: every backend test.
ON_DEVICE = ["tests/test_native_pooling.py", "tests/test_counter_causal.py", "tests/test_cache_invariants.py",
             "tests/test_kvzip.py"]  # fmt: skip


def test_parity_and_invariants_with_the_cache_on_the_device(rpc_endpoint):
    env = dict(os.environ, KVLITE_TEST_RPC=rpc_endpoint, KVLITE_HYPOTHESIS_EXAMPLES="25")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
                           "backend and not slow", *ON_DEVICE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


KERNELS_ON_RPC = """
import json, sys
import numpy as np
from kvlite.native import Native, rpc_add_servers
rpc_add_servers(sys.argv[1])
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 8, 40, 16)).astype(np.float32)
k = rng.standard_normal((2, 2, 300, 16)).astype(np.float16)
out = {}
for device in ("cpu", "RPC0"):
    n = Native(device=device)
    out[device] = dict(on=n.device, pool=n.attn_pool(q, k, pool_kernel=5).tolist(),
                       zip=n.attn_pool(q, k, reduce="max", causal_tail=40).tolist())
print(json.dumps(out))
"""


def test_kernels_run_on_the_device(rpc_endpoint):
    proc = subprocess.run([sys.executable, "-c", KERNELS_ON_RPC, rpc_endpoint], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cpu"]["on"] == "CPU" and out["RPC0"]["on"].startswith("RPC0")
    # KVzip's max: the same f32 graph on the same CPU code behind the socket, to the bit
    np.testing.assert_array_equal(np.array(out["RPC0"]["zip"]), np.array(out["cpu"]["zip"]))
    # the pooled sum: on the CPU alone softmax and sum are one fused op (native/pooling.c) with its
    # own exp (Cephes' polynomial, ~1e-7 relative, where ggml's differs as much) and its own order
    # of the queries' sum; 4e-6 relative is a few float32 ulps of a sum of up to a few dozen terms
    np.testing.assert_allclose(np.array(out["RPC0"]["pool"]), np.array(out["cpu"]["pool"]), rtol=4e-6, atol=1e-9)


CONTEXT_CLOSES = """
import sys
from kvlite.native import rpc_add_servers
rpc_add_servers(sys.argv[1])
from kvlite.engine import Context, Model
m = Model(sys.argv[2], n_gpu_layers=99)
a = Context(m, 256, n_batch=32)
a.decode([5], [0])
a.decode([6], [1])  # the same graph again: llama.cpp reuses it
Context(m, 256, n_batch=32).close()  # frees buffers on the server between two of a's decodes
a.decode([7], [2])
a.state_get(0)  # waits for the server
print("done")
"""


def test_a_context_closing_between_another_contexts_decodes(rpc_endpoint, tiny_paths):
    """ggml's RPC server drops its stored graphs when any buffer is freed, and then refuses a reused
    graph's recompute: the client aborted (kvlite.native.rpc_add_server turns graph reuse off)."""
    proc = subprocess.run([sys.executable, "-c", CONTEXT_CLOSES, rpc_endpoint, tiny_paths["llama"]],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-2000:]
