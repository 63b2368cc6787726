"""Writes tiny f32 GGUF models (llama, qwen2, qwen3 and gemma3 architectures) that llama.cpp loads and runs.

f32 weights keep llama.cpp's matmuls free of activation quantization, so its numbers can be
held to a torch reference tightly. The vocabulary is SentencePiece-style: control tokens, the
printable ASCII characters, and the 256 byte tokens for everything else.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# llama.cpp token types
NORMAL, CONTROL, BYTE = 1, 3, 6


@dataclasses.dataclass(frozen=True)
class TinySpec:
    # "llama" (NORM rope), "qwen2" (NEOX rope, QKV bias, tied output), "qwen3" (Q/K norms) or "gemma3"
    # (Q/K norms, sandwich norms, GeGLU, scaled embeddings, sliding-window layers)
    arch: str = "llama"
    n_layer: int = 3
    n_head: int = 6
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    n_ctx_train: int = 4096
    rope_base: float = 10000.0
    seed: int = 0
    chat_template: bool = False  # a ChatML template (llama.cpp's built-in engine renders it)
    yarn: tuple[float, int] | None = None  # YaRN context extension: (factor, original context)
    rope_freqs: bool = False  # Llama 3's RoPE frequency factors (the rope_freqs.weight tensor)
    sliding_window: int = 0  # gemma3: the window of its local layers
    swa_pattern: int = 2  # gemma3: every swa_pattern-th layer global (llama.cpp's set_swa_pattern)
    rope_base_swa: float = 10000.0  # gemma3: the local layers' RoPE base
    # Real shapes for speed (scripts/bench_shapes.py): a vocabulary padded to n_vocab with unused
    # control tokens (text never tokenizes to them) and "f16" matrices, as GPU users run them.
    n_vocab: int = 0
    weights: str = "f32"

    @property
    def n_embd(self) -> int:
        return self.n_head * self.head_dim


# One tiny model per architecture kvlite supports (models.ARCHS), and Llama 3's RoPE frequency
# factors: the tests' fixtures (tests/conftest.py) and scripts/backend_parity.py.
FIXTURES = {
    "llama": TinySpec(arch="llama", n_layer=3, n_head=6, n_head_kv=2, head_dim=16, seed=1, chat_template=True),
    "llama3": TinySpec(arch="llama", n_layer=2, n_head=4, n_head_kv=2, head_dim=16, seed=4, rope_freqs=True),
    "qwen2": TinySpec(arch="qwen2", n_layer=2, n_head=4, n_head_kv=1, head_dim=32, rope_base=1e6, seed=2),
    "qwen3": TinySpec(arch="qwen3", n_layer=2, n_head=4, n_head_kv=2, head_dim=32, rope_base=1e6, seed=5),
    # layers 0 and 2 slide over the last 16 positions (base 1e4), 1 and 3 see everything (base 1e6)
    "gemma3": TinySpec(
        arch="gemma3",
        n_layer=4,
        n_head=4,
        n_head_kv=1,
        head_dim=16,
        rope_base=1e6,
        seed=6,
        sliding_window=16,
        swa_pattern=2,
    ),
}


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, CONTROL, CONTROL]
    tokens.append("\u2581")  # SentencePiece's space
    types.append(NORMAL)
    for c in range(33, 127):
        tokens.append(chr(c))
        types.append(NORMAL)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(BYTE)
    return tokens, types


def llama3_freq_factors(
    head_dim: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0, n_ctx_orig: int = 1024
) -> np.ndarray:
    """The factors Llama 3.1's converter writes (convert_hf_to_gguf.py, rope_type "llama3"): 1 for
    wavelengths under n_ctx_orig / high, `factor` above n_ctx_orig / low, smooth in between. With a
    16-wide head and base 1e4 the eight frequencies cover all three regimes."""
    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (n_ctx_orig / wavelen - low) / (high - low)
    out = np.where(wavelen < n_ctx_orig / high, 1.0, np.where(wavelen > n_ctx_orig / low, factor, 0.0))
    mid = out == 0.0
    out[mid] = 1.0 / ((1 - smooth[mid]) / factor + smooth[mid])
    return out.astype(np.float32)


def write_tiny_gguf(path: str | pathlib.Path, spec: TinySpec = TinySpec()) -> pathlib.Path:
    import gguf

    path = pathlib.Path(path)
    rng = np.random.default_rng(spec.seed)
    tokens, types = vocabulary()
    tokens += [f"<unused{i}>" for i in range(spec.n_vocab - len(tokens))]
    types += [CONTROL] * (len(tokens) - len(types))
    n_vocab, E, D = len(tokens), spec.n_embd, spec.head_dim
    if spec.weights not in ("f32", "f16"):
        raise ValueError(f"weights must be f32 or f16, got {spec.weights!r}")

    def normal(shape: tuple[int, int], scale: float) -> np.ndarray:
        if spec.weights == "f16":  # drawn in f32: a 1B shape's 1.5e9 draws in float64 take twice as long
            return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return normal((n_out, n_in), 1 / np.sqrt(n_in))

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), spec.arch)
    _write_metadata(w, spec, tokens, types)

    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(D, spec.rope_base))
    # Small embeddings keep tied output heads (qwen2) from saturating every softmax.
    w.add_tensor("token_embd.weight", normal((n_vocab, E), 0.3))
    for i in range(spec.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm_weight())
        # Larger query/key weights give peaked attention, so eviction visibly changes the outputs.
        w.add_tensor(f"blk.{i}.attn_q.weight", 2.0 * mat(spec.n_head * D, E))
        w.add_tensor(f"blk.{i}.attn_k.weight", 2.0 * mat(spec.n_head_kv * D, E))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(spec.n_head_kv * D, E))
        if spec.arch in ("qwen3", "gemma3"):  # per-head norms, weights near 1 as trained models have them
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", (1.0 + 0.2 * rng.standard_normal(D)).astype(np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", (1.0 + 0.2 * rng.standard_normal(D)).astype(np.float32))
        if spec.arch == "qwen2":
            w.add_tensor(f"blk.{i}.attn_q.bias", (0.5 * rng.standard_normal(spec.n_head * D)).astype(np.float32))
            w.add_tensor(f"blk.{i}.attn_k.bias", (0.5 * rng.standard_normal(spec.n_head_kv * D)).astype(np.float32))
            w.add_tensor(f"blk.{i}.attn_v.bias", (0.1 * rng.standard_normal(spec.n_head_kv * D)).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(E, spec.n_head * D))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm_weight())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(spec.n_ff, E))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(spec.n_ff, E))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(E, spec.n_ff))
        if spec.arch == "gemma3":
            w.add_tensor(f"blk.{i}.post_attention_norm.weight", norm_weight())
            w.add_tensor(f"blk.{i}.post_ffw_norm.weight", norm_weight())
    w.add_tensor("output_norm.weight", norm_weight())
    if spec.arch not in ("qwen2", "gemma3"):  # these tie the output head to the embeddings
        w.add_tensor("output.weight", mat(n_vocab, E))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_metadata(w, spec: TinySpec, tokens: list[str], types: list[int]) -> None:
    """The fixture's key-value metadata: the model's shape, RoPE and the tokenizer."""
    import gguf

    w.add_name(f"tiny-{spec.arch}")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(spec.rope_base)
    if spec.arch == "gemma3":
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_sliding_window(spec.sliding_window)
        w.add_sliding_window_pattern(spec.swa_pattern)
        w.add_rope_freq_base_swa(spec.rope_base_swa)
    if spec.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn[0])
        w.add_rope_scaling_orig_ctx_len(spec.yarn[1])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if spec.weights == "f16" else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    if spec.chat_template:
        w.add_chat_template(CHATML)
