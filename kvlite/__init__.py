"""kvlite: KV-cache eviction for quantized GGUF models on llama.cpp."""

__version__ = "0.1.0"

from .api import Session  # noqa: E402
from .errors import KvliteError  # noqa: E402
from .policies import (  # noqa: E402
    H2O,
    LAQ,
    TOVA,
    CounterCausal,
    CounterCausalBlind,
    CounterCausalFast,
    DapQ,
    EchoKV,
    FullKV,
    SnapKV,
    StreamingLLM,
    make_policy,
)

__all__ = [
    "H2O", "LAQ", "TOVA", "CounterCausal", "CounterCausalBlind", "CounterCausalFast", "DapQ", "EchoKV", "FullKV",
    "KvliteError", "Session", "SnapKV", "StreamingLLM", "__version__", "make_policy",
]  # fmt: skip
