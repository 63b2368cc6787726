"""Torch twin of the native counter-causal pass: the model over the cached tokens in their
original order, each token attending only to the cached K/V of later positions."""

from __future__ import annotations

import torch

from .model import ReferenceModel


def counter_causal_logits(
    ref: ReferenceModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_layer: int = 0,
    hidden: torch.Tensor | None = None,
    score: str = "raw",
    min_gap: int = 0,
    blind: bool = False,
) -> torch.Tensor:
    """Cells in ascending position order. k, v: [n_layer - first_layer, n, Hkv, D] (the cache);
    hidden: the input of first_layer [n, n_embd] when first_layer > 0. Returns [n]: the logit of
    x_i at cell i (score "raw") or its log-probability ("logprob"); cell i sees cells j > i + min_gap
    (indices), so the last min_gap + 1 cells see nothing and come out NaN. blind (kvlite's own
    variant, first_layer 0): every cell's input is the mean token embedding instead of its own, so
    x_i is predicted from the later cells' K/V alone."""
    assert torch.all(positions[1:] > positions[:-1]), "cells in ascending position order"
    if blind:
        assert first_layer == 0, "the blind variant recomputes every layer"
        x = ref.tok_embd.mean(dim=0).expand(len(tokens), -1)
    else:
        x = hidden if first_layer > 0 else ref.tok_embd[tokens]
    idx = torch.arange(len(tokens))
    visible = idx[None, :] > idx[:, None] + min_gap  # query i sees later cells only
    for il in range(first_layer, ref.info.n_layer):
        _, q = ref.query(il, x, positions)
        x = ref.attend_and_ffn(il, x, q, k[il - first_layer], v[il - first_layer], visible)
    logits = ref.output_logits(x)
    raw = logits.gather(1, tokens[:, None])[:, 0]
    out = raw - torch.logsumexp(logits, dim=-1) if score == "logprob" else raw
    out[len(tokens) - 1 - min_gap :] = float("nan")
    return out
