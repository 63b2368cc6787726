"""kvlite: KV-cache eviction for quantized GGUF models on llama.cpp."""

__version__ = "0.1.0"

from .errors import KvliteError  # noqa: E402

__all__ = ["KvliteError", "__version__"]
