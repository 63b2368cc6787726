"""Token sampling through llama.cpp's sampler chain (greedy when temperature is 0)."""

from __future__ import annotations

import ctypes
import dataclasses

import llama_cpp as L
import numpy as np

from ..errors import KvliteError
from ..limits import UINT32_MAX, check_int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0  # 0: greedy
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.temp < float("inf"):  # NaN fails every comparison
            raise KvliteError(f"--temp must be a finite number >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise KvliteError(f"--top-p must be in (0, 1], got {self.top_p}")
        check_int("--top-k", self.top_k)  # llama.cpp's int32: 2^32 + 1 would wrap to 1, greedy
        check_int("--seed", self.seed, -1, UINT32_MAX)  # -1: llama.cpp's random seed


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        chain_params = L.llama_sampler_chain_default_params()
        self.ptr = L.llama_sampler_chain_init(chain_params)
        if params.temp == 0:
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_top_k(params.top_k))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_top_p(params.top_p, 1))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_temp(params.temp))
            L.llama_sampler_chain_add(self.ptr, L.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def sample(self, ctx_ptr, row: int = -1) -> int:
        """Sample from row `row` of the last decode's logits (and tell the chain what was chosen)."""
        return int(L.llama_sampler_sample(self.ptr, ctx_ptr, row))

    def sample_logits(self, logits: np.ndarray) -> int:
        """Sample from a saved logits vector (the context's own row may have been overwritten, e.g.
        by lookahead decodes on a workspace)."""
        n = len(logits)
        arr = (L.llama_token_data * n)()
        view = np.ctypeslib.as_array(arr)
        view["id"] = np.arange(n)
        view["logit"] = logits
        view["p"] = 0.0
        cur = L.llama_token_data_array(data=arr, size=n, selected=-1, sorted=False)
        L.llama_sampler_apply(self.ptr, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        L.llama_sampler_accept(self.ptr, token)
        return token

    def close(self) -> None:
        if getattr(self, "ptr", None):
            L.llama_sampler_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        self.close()
