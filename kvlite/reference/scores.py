"""Torch twins of the native score kernels, written from the papers' definitions."""

from __future__ import annotations

import torch


def attn_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    pool_kernel: int = 0,
    reduce: str = "sum",
    causal_tail: int = 0,
) -> torch.Tensor:
    """EchoKV Eq. 3: s[l, g, i] = sum over queries q of KV group g of softmax_i(q . k_i * scale).

    q: [n_layer, n_head, n_q, D]; k: [n_layer, n_head_kv, n_keys, D]; query head h belongs to
    group h // (n_head // n_head_kv). key_mask (bool [n_keys]): keys outside the softmax.
    pool_kernel: SnapKV's smoothing, max_pool1d(kernel, stride 1, padding kernel // 2) over keys.
    reduce "max" (KVzip): the largest probability over the group's queries and query heads.
    causal_tail: the last n_q keys are the queries' own, query r sees tail key j only for j <= r.
    Returns [n_layer, n_head_kv, n_keys]."""
    n_layer, n_head, n_q, d = q.shape
    n_head_kv, n_keys = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    kh = k.repeat_interleave(n_head // n_head_kv, dim=1)  # [n_layer, n_head, n_keys, D]
    logits = torch.einsum("lhqd,lhnd->lhqn", q, kh) * scale
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask, float("-inf"))
    if causal_tail:
        r = torch.arange(n_q)[:, None]
        j = torch.arange(n_keys)[None, :] - (n_keys - causal_tail)
        logits = logits.masked_fill(j > r, float("-inf"))
    p = torch.softmax(logits, dim=-1).reshape(n_layer, n_head_kv, -1, n_keys)
    s = p.amax(dim=2) if reduce == "max" else p.sum(dim=2)
    if pool_kernel > 1:
        s = torch.nn.functional.max_pool1d(s, pool_kernel, stride=1, padding=pool_kernel // 2)
    return s


def knorm(k: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
    """K-norm's keep-score (Devoto et al., 2024): minus the L2 norm of each token's key, averaged
    over layers from first_layer and KV heads. k: [n_layer, n_head_kv, n_keys, D]; returns [n_keys]."""
    return -torch.linalg.vector_norm(k[first_layer:], dim=-1).mean(dim=(0, 1))
