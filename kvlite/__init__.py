"""kvlite: KV-cache eviction for quantized GGUF models on llama.cpp.

The names below are imported on first use (PEP 562), so `kvlite` the command starts without
loading numpy or llama.cpp until it needs them.
"""

import _signal  # the C module: `signal` imports enum first, ~10 ms in which a Ctrl-C printed a traceback
import os as _os  # already imported by site: free
import sys as _sys


def _interrupted_while_starting(signum, frame) -> None:
    _os.write(2, b"\nkvlite: interrupted\n")
    _os._exit(130)


# Run as the `kvlite` command, a Ctrl-C while modules import ends it with one line, as one at any
# later moment does (cli.main puts Python's handler back once it runs). Imported as a library,
# nothing changes.
_argv0 = _os.path.normpath(_sys.argv[0]) if _sys.argv and _sys.argv[0] else ""
if _os.path.basename(_argv0) == "kvlite" or _argv0.endswith(_os.path.join("kvlite", "__main__.py")):
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)

import importlib  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

__version__ = "0.1.0"

_EXPORTS = {
    "Session": "api", "Conversation": "api", "RunSettings": "runner", "KvliteError": "errors",
    **{name: "policies" for name in ("H2O", "LAQ", "TOVA", "CounterCausal", "CounterCausalBlind",
                                     "CounterCausalFast", "DapQ", "EchoKV", "FullKV", "KNorm", "SnapKV",
                                     "StreamingLLM", "make_policy")},
}  # fmt: skip

if TYPE_CHECKING:
    from .api import Conversation, Session
    from .errors import KvliteError
    from .policies import (
        H2O,
        LAQ,
        TOVA,
        CounterCausal,
        CounterCausalBlind,
        CounterCausalFast,
        DapQ,
        EchoKV,
        FullKV,
        KNorm,
        SnapKV,
        StreamingLLM,
        make_policy,
    )  # fmt: skip
    from .runner import RunSettings


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlite' has no attribute '{name}'")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "H2O", "LAQ", "TOVA", "Conversation", "CounterCausal", "CounterCausalBlind", "CounterCausalFast", "DapQ",
    "EchoKV", "FullKV", "KNorm", "KvliteError", "RunSettings", "Session", "SnapKV", "StreamingLLM", "__version__",
    "make_policy",
]  # fmt: skip
