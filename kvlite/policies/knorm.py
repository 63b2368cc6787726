"""K-norm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"; kvpress's KnormPress): keep the tokens whose cached keys have the lowest L2 norm.
It observes no query at all, so it needs no capture. RoPE is a rotation: the norm of a cached
(post-RoPE) key is the norm of the key itself.

Also the worked example of docs/policies.md ("Adding a policy"): one class, one parameter."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ..errors import KvliteError
from .base import Policy, param
from .observe import Observation

if TYPE_CHECKING:
    from ..models import ModelInfo


@dataclasses.dataclass
class KNorm(Policy):
    """first_layer: layers before it do not vote (their key norms are the least informative in
    the paper's analysis; 0 = every layer counts, kvpress's default)."""

    name = "knorm"
    reads = "the norms of the cached keys of {layers} from --first-layer on"
    first_layer: int = param(0, "--first-layer", "knorm: the first layer whose key norms count", minimum=0)

    def check_model(self, info: ModelInfo) -> None:
        if self.first_layer >= info.n_layer:
            raise KvliteError(f"{self.flag('first_layer')} {self.first_layer}: the model has {info.n_layer} layers")
        if not self._layers(info):
            raise KvliteError(f"{self.flag('first_layer')} {self.first_layer}: no layer from there on holds every cell")

    def _layers(self, info: ModelInfo) -> list[int]:
        return [il for il in info.full_layers if il >= self.first_layer]  # sliding layers hold the window only

    def scores(self, obs: Observation) -> np.ndarray:
        self.check_model(obs.info)
        layers = self._layers(obs.info)
        norms = [np.linalg.norm(obs.keys.layer(il).astype(np.float32), axis=-1).mean(axis=0) for il in layers]
        return -np.mean(norms, axis=0)  # low norm = kept first
