"""Shared fixtures: tiny f32 GGUF models written with the gguf package, the default model, and a
way to run the CLI as a user does."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import pytest

from kvlite.reference.tiny_gguf import FIXTURES, write_tiny_gguf


def pytest_configure(config):
    """KVLITE_TEST_RPC=HOST:PORT runs the session against a ggml RPC server: every model loaded
    offloads its layers and KV cache there and kvlite's kernels run there (tests/test_offload.py
    runs the parity and invariant modules this way)."""
    if os.environ.get("KVLITE_TEST_RPC"):
        from kvlite.native import rpc_add_servers

        rpc_add_servers(os.environ["KVLITE_TEST_RPC"])


# One tiny model per architecture kvlite supports (kvlite.reference.tiny_gguf.FIXTURES): every test
# taking `tiny_path` runs on each.
TINY_SPECS = FIXTURES


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tiny")
    return {arch: str(write_tiny_gguf(d / f"tiny-{arch}.gguf", spec)) for arch, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session", params=sorted(TINY_SPECS))
def tiny_path(request, tiny_paths) -> str:
    return tiny_paths[request.param]


@pytest.fixture(scope="session", params=sorted(TINY_SPECS))
def tiny_arch_model(request, tiny_paths):
    """Each architecture's tiny model, loaded."""
    from kvlite.engine import Model

    return Model(tiny_paths[request.param])


@pytest.fixture(scope="session")
def tiny_model(tiny_paths):
    from kvlite.engine import Model

    return Model(tiny_paths["llama"])


@pytest.fixture(scope="session")
def smol_path() -> str:
    from kvlite.models import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def smol_model(smol_path):
    from kvlite.engine import Model

    return Model(smol_path)


def on_backend(values, chosen) -> list:
    """Parametrize values, those in `chosen` marked `backend`: a GPU backend's run (pytest -m
    backend, scripts/vulkan_check.sh) takes one case per device code path, the CPU suite all."""
    return [pytest.param(v, marks=pytest.mark.backend) if v in chosen else v for v in values]


KVLITE = str(pathlib.Path(sys.executable).parent / "kvlite")  # the installed console script


def free_port() -> int:
    """A port nothing listens on now (another process could still take it before the test binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """Run `kvlite ARGS` as a user would: the installed script, outside the source tree."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [KVLITE, *args],
        cwd=cwd or tempfile.gettempdir(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
