"""kvlite: KV-cache eviction for quantized GGUF models on llama.cpp.

The names below are imported on first use (PEP 562), so `kvlite` the command starts without
loading numpy or llama.cpp until it needs them.
"""

import _signal  # the C module: `signal` imports enum first, a window in which a Ctrl-C printed a traceback
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

# Imported on first use: these names from their modules, and every policy class the registry holds
# (kvlite.policies.POLICIES, by class name), so that a new policy is exported without a line here.
_EXPORTS = {"Session": "api", "Conversation": "api", "RunSettings": "settings", "KvliteError": "errors",
            "make_policy": "policies"}  # fmt: skip

if TYPE_CHECKING:
    from .api import Conversation as Conversation
    from .api import Session as Session
    from .errors import KvliteError as KvliteError
    from .policies import *  # noqa: F403  -- the registry's classes (at run time: _policy_classes)
    from .settings import RunSettings as RunSettings


def _policy_classes() -> dict[str, type]:
    return {cls.__name__: cls for cls in importlib.import_module(".policies", __name__).POLICIES.values()}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(f".{module}", __name__), name)
    if name == "__all__":  # `from kvlite import *`: the policy classes are known once the registry is loaded
        return ["__version__", *_EXPORTS, *sorted(_policy_classes())]
    # A class name only: `from kvlite import models` asks for a submodule here first, and must not
    # load the registry (numpy, llama.cpp) on the way
    if name[:1].isupper() and name in (classes := _policy_classes()):
        return classes[name]
    raise AttributeError(f"module 'kvlite' has no attribute '{name}'")
