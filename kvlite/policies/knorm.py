"""K-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"; kvpress's KnormPress): keep the tokens whose cached keys have the lowest L2 norm.
It observes no query at all, so it needs no capture. RoPE is a rotation: the norm of a cached
(post-RoPE) key is the norm of the key itself.

Also the worked example of docs/policies.md ("Adding a policy"): one class, one parameter."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import KvliteError
from .base import Policy, param
from .observe import Observation


@dataclasses.dataclass
class KNorm(Policy):
    """first_layer: layers before it do not vote (their key norms are the least informative in
    the paper's analysis; 0 = every layer counts, kvpress's default)."""

    name = "knorm"
    first_layer: int = param(0, "--first-layer", "knorm: the first layer whose key norms count", minimum=0)

    def scores(self, obs: Observation) -> np.ndarray:
        keys = obs.keys[self.first_layer :].astype(np.float32)  # [L, Hkv, n, D]
        if not len(keys):
            raise KvliteError(f"{self.flag('first_layer')} {self.first_layer}: the model has {obs.info.n_layer} layers")
        return -np.linalg.norm(keys, axis=-1).mean(axis=(0, 1))  # low norm = kept first
