"""Torch twins of the native score kernels, written from the papers' definitions."""

from __future__ import annotations

import torch


def attn_pool(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """EchoKV Eq. 3: s[l, g, i] = sum over queries q of KV group g of softmax_i(q . k_i * scale).

    q: [n_layer, n_head, n_q, D]; k: [n_layer, n_head_kv, n_keys, D]; query head h belongs to
    group h // (n_head // n_head_kv). Returns [n_layer, n_head_kv, n_keys]."""
    n_layer, n_head, n_q, d = q.shape
    n_head_kv = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    kh = k.repeat_interleave(n_head // n_head_kv, dim=1)  # [n_layer, n_head, n_keys, D]
    p = torch.softmax(torch.einsum("lhqd,lhnd->lhqn", q, kh) * scale, dim=-1)
    return p.reshape(n_layer, n_head_kv, -1, k.shape[2]).sum(dim=2)
