"""Counter-causal surprise ("Back from the Future", Section 3.1), computed by kvlite's native
library on the GGUF's own weights (memory-mapped, quantized as stored) and the cached K/V.

For every resident cell i: the logit of its token x_i when the model reads the cache in original
order but each token attends only to cells of later positions. A low logit means the later context
cannot predict x_i: surprising, keep it. `score="raw"` is the paper's logit; `"logprob"` subtracts
the log-sum-exp over the vocabulary, which makes positions comparable (the raw logit ranked a
stated-once answer among the first tokens evicted: docs/design.md, "The peers").
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from ..errors import KvliteError
from ..models import ModelInfo
from ..native import HParams, native

VARIANTS = ("full", "fast")
SCORES = ("raw", "logprob")


@dataclasses.dataclass
class CacheContents:
    """What a counter-causal pass reads, in ascending position order: tokens, positions, and per
    layer K and V rows [n, n_head_kv * head_dim] (for the layers the pass recomputes)."""

    tokens: np.ndarray
    positions: np.ndarray
    k: np.ndarray | LayerRows  # [n_layer_used, n, n_embd_kv], float16 or float32; k[i]: one layer
    v: np.ndarray | LayerRows
    hidden: np.ndarray | None = None  # [n, n_embd], the input of the first recomputed layer


class LayerRows:
    """Some layers' cached rows, read when indexed: rows[i] is layer layers[i], [n, n_embd_kv]."""

    def __init__(self, read, layers: range):
        self.read, self.layers = read, layers

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(self.layers[i])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = np.stack([self[i] for i in range(len(self))])
        return rows if dtype is None else rows.astype(dtype, copy=False)


class SurpriseModel:
    """A model's weights mapped for counter-causal passes (one per GGUF file)."""

    def __init__(self, info: ModelInfo):
        self.info = info
        self._native = native()
        self.ptr = self._native.model_load(info.path, HParams.of(info))
        self._neutral: np.ndarray | None = None
        self._finalizer = weakref.finalize(self, self._native.model_free, self.ptr)

    def neutral_input(self) -> np.ndarray:
        """The blind variant's input row: the mean of the token embedding matrix (dequantized from
        the GGUF as stored), a token that is none of the vocabulary's in particular."""
        if self._neutral is None:
            self._neutral = mean_embedding(self.info.path)
        return self._neutral

    def first_layer(self, variant: str) -> int:
        if variant not in VARIANTS:
            raise KvliteError(f"unknown counter-causal variant '{variant}': choose from {', '.join(VARIANTS)}")
        return 0 if variant == "full" else self.info.n_layer - 1

    def logits(
        self,
        contents: CacheContents,
        variant: str = "fast",
        score: str = "raw",
        min_gap: int = 0,
        block_rows: int = 0,
        blind: bool = False,
    ) -> np.ndarray:
        """The counter-causal logit (or log-probability) of x_i at every cell, ascending position
        order. Cell i attends to the cells after it but the nearest min_gap (index distance, as
        the reference code's min_gap). The last min_gap + 1 cells have no later context: NaN
        (callers keep them always). block_rows: queries per attention block (0: automatic, the
        score matrix near 64 MB). blind (full variant only, kvlite's own): the input at position i
        is the neutral embedding instead of x_i's, so x_i is predicted from the later cells alone."""
        if score not in SCORES:
            raise KvliteError(f"unknown surprise score '{score}': choose from {', '.join(SCORES)}")
        first = self.first_layer(variant)
        info = self.info
        n = len(contents.tokens)
        n_used, n_kv = info.n_layer - first, info.n_head_kv * info.head_dim
        pos = np.asarray(contents.positions)
        if n == 0 or pos.shape != (n,) or np.any(np.diff(pos) <= 0):
            raise KvliteError("counter-causal pass needs cells in strictly ascending position order")
        if min_gap < 0:
            raise KvliteError(f"min_gap must be >= 0, got {min_gap}")
        if n <= min_gap + 1:
            return np.full(n, np.nan, np.float32)  # no cell has anything after it to be predicted from
        for name, a in (("k", contents.k), ("v", contents.v)):
            if len(a) != n_used:  # each layer's shape is checked as it is read
                raise KvliteError(f"counter-causal {variant}: {name} has the shape of {len(a)} layers, want {n_used}")
        hidden = None
        if blind:
            if first > 0:
                raise KvliteError("the blind counter-causal variant recomputes every layer: use variant 'full'")
            hidden = np.ascontiguousarray(np.broadcast_to(self.neutral_input(), (n, info.n_embd)), dtype=np.float32)
        elif first > 0:
            if contents.hidden is None or contents.hidden.shape != (n, info.n_embd):
                raise KvliteError(f"counter-causal fast needs the hidden states [{n}, {info.n_embd}] of every cell")
            hidden = np.ascontiguousarray(contents.hidden[::-1], dtype=np.float32)  # a copy: updated in place
        # The native pass takes cells in descending position order: "only later positions" is then
        # ggml's ordinary causal mask. One layer at a time: the hidden rows [n, n_embd] are the
        # only state carried between layers, and one layer's K/V is read at a time.
        nat, tokens = self._native, contents.tokens[::-1]
        if hidden is None:
            hidden = nat.cc_embed(self.ptr, tokens, info.n_embd)
        for i, il in enumerate(range(first, info.n_layer)):
            k, v = contents.k[i], contents.v[i]
            for name, a in (("k", k), ("v", v)):
                if a.shape != (n, n_kv):
                    raise KvliteError(f"counter-causal {variant}: {name} of layer {il} has shape {a.shape}, "
                                      f"want {(n, n_kv)}")  # fmt: skip
            nat.cc_layer(self.ptr, il, min_gap, block_rows, pos[::-1], k[::-1], v[::-1], hidden)
        out = nat.cc_output(self.ptr, score == "logprob", block_rows, tokens, hidden)[::-1].copy()
        out[n - 1 - min_gap :] = np.nan
        return out


def mean_embedding(path) -> np.ndarray:
    """Mean over the vocabulary of the GGUF's token_embd rows, float32 [n_embd]."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from ..gguf_header import read_header, tensor_nbytes

    header = read_header(str(path))
    t = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if t is None:
        raise KvliteError(f"{path} has no token_embd.weight")
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_start + t.offset, shape=(tensor_nbytes(t),))
    rows = dequantize(np.asarray(raw).reshape(t.shape[1], -1), GGMLQuantizationType(t.ggml_type))
    return rows.reshape(t.shape[1], t.shape[0]).mean(axis=0, dtype=np.float64).astype(np.float32)


def surprise(logits: np.ndarray) -> np.ndarray:
    """Keep-scores from counter-causal logits: higher = more surprising = kept first; the last
    cells, which have no future to be predicted from (NaN), get the maximum."""
    s = -np.asarray(logits, dtype=np.float64)
    s[np.isnan(s)] = np.inf
    return s


def cache_contents(cache, model: SurpriseModel, variant: str) -> CacheContents:
    """Everything a counter-causal pass needs, read from the live cache: K/V from llama.cpp's
    state, tokens from the token buffer, hidden states (fast) kept beside it."""
    first = model.first_layer(variant)
    kv = cache.cached_kv()  # read a layer at a time as the pass goes
    layers = range(first, model.info.n_layer)
    positions, k, v = kv.positions, LayerRows(kv.k_rows, layers), LayerRows(kv.v_rows, layers)
    hidden = None
    if first > 0:
        if cache.hidden is None or cache.hidden_layer != first - 1:
            raise KvliteError(f"counter-causal fast needs the cache to keep hidden states of layer {first - 1}")
        hidden = cache.hidden
    tokens = np.asarray(cache.tokens_at(positions), dtype=np.int32)
    return CacheContents(tokens=tokens, positions=positions, k=k, v=v, hidden=hidden)
