"""A torch re-implementation of llama.cpp's llama, qwen2, qwen3 and gemma3 graphs, read from the same GGUF file.

It is the yardstick the engine and the native kernels are held to: it computes what llama.cpp
should compute at explicit positions, with a KV cache whose entries can be evicted (leaving holes
in positions) exactly as kvlite evicts cells. Weights are used as stored in the GGUF (llama's Q/K
rows are already permuted for NORM rope by llama.cpp's converter), dequantized to float.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..models import ModelInfo, read_model_info


@dataclasses.dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None  # qwen3: per-head RMS norm weights [head_dim] of Q and K before RoPE
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    post_attn_norm: torch.Tensor | None  # gemma3: after attention and after the FFN
    post_ffw_norm: torch.Tensor | None


def load_gguf_tensors(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        a = np.asarray(dequantize(t.data, t.tensor_type))
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml ne -> numpy order
        out[t.name] = torch.from_numpy(a.reshape(shape).astype(np.float64)).to(dtype)
    return out


class RefCache:
    """Per-layer K and V at explicit positions (post-RoPE K, as llama.cpp caches it)."""

    def __init__(self, n_layer: int):
        self.k: list[torch.Tensor | None] = [None] * n_layer  # [n, Hkv, D]
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.pos = torch.zeros(0, dtype=torch.long)

    def keep(self, positions) -> None:
        """Evict every cached entry whose position is not in `positions`."""
        want = torch.as_tensor(np.asarray(list(positions)), dtype=torch.long)
        mask = torch.isin(self.pos, want)
        self.pos = self.pos[mask]
        self.k = [k[mask] for k in self.k]
        self.v = [v[mask] for v in self.v]


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU (ggml-cpu/vec.h, GGML_GELU_FP16): the tanh form looked up in an f16 table, so
    the input is rounded to f16 and so is the output; exact below -10 (0) and above 10 (x)."""
    x16 = x.to(torch.float16).to(torch.float32)
    y = 0.5 * x16 * (1.0 + torch.tanh(0.7978845608028654 * x16 * (1.0 + 0.044715 * x16 * x16)))
    y = y.to(torch.float16).to(x.dtype)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


def cpu_arithmetic() -> bool:
    """Whether a model loaded with every layer offloaded computes on ggml's CPU backend here: no GPU
    device, or an RPC one (kvlite's tests serve this machine's CPU backend over RPC)."""
    from ..native import default_device

    device = default_device()
    return device == "cpu" or device.startswith("RPC")


def exact_gelu(x: torch.Tensor) -> torch.Tensor:
    """The same tanh form computed as it stands, as ggml's GPU backends do (ggml-vulkan's geglu
    shader: no f16 table)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def rope(x: torch.Tensor, pos: torch.Tensor, base: float, mode: str, factors=None) -> torch.Tensor:
    """x: [T, heads, D] rotated to positions pos [T]. norm: pairs (2i, 2i+1); neox: (i, i + D/2).
    factors [D/2] (Llama 3's rope_freqs): frequency i's angle divided by factors[i], as ggml does."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    if factors is not None:
        inv = inv / torch.as_tensor(factors, dtype=torch.float64)
    theta = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos = torch.cos(theta)[:, None, :].to(x.dtype)
    sin = torch.sin(theta)[:, None, :].to(x.dtype)
    if mode == "norm":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


class ReferenceModel:
    def __init__(self, path: str, dtype: torch.dtype = torch.float64, kv_dtype: torch.dtype | None = None,
                 gelu: str = "auto"):  # fmt: skip
        """kv_dtype: the precision llama.cpp stores K/V in (torch.float16 for its default f16
        cache); cached values are rounded to it, as llama.cpp does when it writes a cell.
        gelu: "table" (ggml's CPU backend: ggml_gelu) or "exact" (its GPU backends: exact_gelu);
        "auto": as the backend that runs the layers (cpu_arithmetic)."""
        if gelu == "auto":
            gelu = "table" if cpu_arithmetic() else "exact"
        self.gelu = {"table": ggml_gelu, "exact": exact_gelu}[gelu]
        self.info: ModelInfo = read_model_info(path)
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        w = load_gguf_tensors(str(path), dtype)
        self.tok_embd = w["token_embd.weight"]
        self.out_norm = w["output_norm.weight"]
        self.output = w.get("output.weight", self.tok_embd)  # tied embeddings when absent
        self.layers = [
            LayerWeights(
                attn_norm=w[f"blk.{i}.attn_norm.weight"],
                wq=w[f"blk.{i}.attn_q.weight"],
                wk=w[f"blk.{i}.attn_k.weight"],
                wv=w[f"blk.{i}.attn_v.weight"],
                wo=w[f"blk.{i}.attn_output.weight"],
                bq=w.get(f"blk.{i}.attn_q.bias"),
                bk=w.get(f"blk.{i}.attn_k.bias"),
                bv=w.get(f"blk.{i}.attn_v.bias"),
                q_norm=w.get(f"blk.{i}.attn_q_norm.weight"),
                k_norm=w.get(f"blk.{i}.attn_k_norm.weight"),
                ffn_norm=w[f"blk.{i}.ffn_norm.weight"],
                w_gate=w[f"blk.{i}.ffn_gate.weight"],
                w_up=w[f"blk.{i}.ffn_up.weight"],
                w_down=w[f"blk.{i}.ffn_down.weight"],
                post_attn_norm=w.get(f"blk.{i}.post_attention_norm.weight"),
                post_ffw_norm=w.get(f"blk.{i}.post_ffw_norm.weight"),
            )
            for i in range(self.info.n_layer)
        ]

    def new_cache(self) -> RefCache:
        return RefCache(self.info.n_layer)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMS norm over the last dimension (no weight: none, as for a model without Q/K norms)."""
        if weight is None:
            return x
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.info.rms_eps) * weight

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, il: int) -> torch.Tensor:
        info = self.info
        return rope(x, pos, info.layer_rope_base(il), info.rope_type, info.rope_freq_factors)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        y = x @ w.T
        return y if b is None else y + b

    def query(self, il: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre- and post-RoPE queries [T, H, D] of layer il for inputs x [T, n_embd]."""
        info, lw = self.info, self.layers[il]
        h = self._norm(x, lw.attn_norm)
        q_pre = self._norm(self._linear(h, lw.wq, lw.bq).view(x.shape[0], info.n_head, info.head_dim), lw.q_norm)
        return q_pre, self._rope(q_pre, pos, il)

    def key_value(self, il: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE keys and values [T, Hkv, D] of layer il, rounded to the cache's precision."""
        info, lw = self.info, self.layers[il]
        h = self._norm(x, lw.attn_norm)
        shape = (x.shape[0], info.n_head_kv, info.head_dim)
        k = self._rope(self._norm(self._linear(h, lw.wk, lw.bk).view(shape), lw.k_norm), pos, il)
        v = self._linear(h, lw.wv, lw.bv).view(shape)
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(self.dtype), v.to(self.kv_dtype).to(self.dtype)
        return k, v

    def attend_and_ffn(self, il: int, x, q, keys, values, visible) -> torch.Tensor:
        """The rest of block il: attention of queries q [T, H, D] over keys/values [N, Hkv, D]
        where visible [T, N] allows, the residual, the feed-forward. Returns the block's output."""
        info, lw = self.info, self.layers[il]
        group = info.n_head // info.n_head_kv
        kh = keys.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        vh = values.repeat_interleave(group, dim=1)
        att = torch.einsum("thd,nhd->htn", q, kh) * info.kq_scale
        att = att.masked_fill(~visible[None], float("-inf")).softmax(-1)
        o = torch.einsum("htn,nhd->thd", att, vh).reshape(x.shape[0], -1)
        x = x + self._norm(o @ lw.wo.T, lw.post_attn_norm)
        h = self._norm(x, lw.ffn_norm)
        act = self.gelu if info.ffn_act == "gelu" else torch.nn.functional.silu
        return x + self._norm((act(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T, lw.post_ffw_norm)

    def embed(self, tokens) -> torch.Tensor:
        x = self.tok_embd[torch.as_tensor(np.asarray(list(tokens)), dtype=torch.long)]
        if self.info.embd_scale:  # ggml_scale by sqrtf(n_embd), an f32 factor
            x = x * float(np.float32(np.sqrt(self.info.n_embd)))
        return x

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self._norm(x, self.out_norm) @ self.output.T
        cap = self.info.logit_softcap
        return logits if not cap else cap * torch.tanh(logits / cap)

    def forward(self, tokens, positions, cache: RefCache, capture: dict | None = None, visible=None) -> torch.Tensor:
        """Process tokens at positions on top of the cache (which grows by them). Each token
        attends to cached entries and new tokens at positions <= its own, like llama.cpp's mask,
        unless `visible` ([T, n_cached + T] bool) says otherwise. Returns logits [T, n_vocab]; if
        capture is a dict it receives per layer "q_pre", "q" ([T, H, D]), "k" ([T, Hkv, D]) and
        "hidden" (the input of each layer, [T, n_embd])."""
        pos = torch.as_tensor(np.asarray(list(positions)), dtype=torch.long)
        x = self.embed(tokens)
        all_pos = torch.cat([cache.pos, pos])
        if visible is None:
            visible = all_pos[None, :] <= pos[:, None]
        # a sliding-window layer sees the keys less than n_swa positions back (llama_hparams::is_masked_swa)
        in_window = (pos[:, None] - all_pos[None, :]) < self.info.n_swa
        for il in range(self.info.n_layer):
            if capture is not None:
                capture[("hidden", il)] = x.clone()
            q_pre, q = self.query(il, x, pos)
            k, v = self.key_value(il, x, pos)
            if capture is not None:
                capture[("q_pre", il)], capture[("q", il)], capture[("k", il)] = q_pre, q, k
            ks = k if cache.k[il] is None else torch.cat([cache.k[il], k])
            vs = v if cache.v[il] is None else torch.cat([cache.v[il], v])
            cache.k[il], cache.v[il] = ks, vs
            x = self.attend_and_ffn(il, x, q, ks, vs, visible & in_window if il in self.info.swa_layers else visible)
        cache.pos = all_pos
        return self.output_logits(x)
