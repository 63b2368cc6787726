"""EchoKV Eq. 2: ggml's RoPE, called by kvlite, reproduces the rotation llama.cpp applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlite.cache import KVCache
from kvlite.engine import Capture, Context, Model
from kvlite.reference.model import cpu_arithmetic
from kvlite.reference.model import rope as torch_rope
from kvlite.reference.tiny_gguf import TinySpec, llama3_freq_factors, write_tiny_gguf
from kvlite.scoring.proposals import proposals, rope


def _captured(path: str, n: int):
    model = Model(path)
    cap = Capture(model.info)
    layers = range(model.info.n_layer)
    cap.request("q_pre", layers)
    cap.request("q", layers)
    ctx = Context(model, n_ctx=n + 64, n_batch=128, capture=cap)
    rng = np.random.default_rng(0)
    KVCache(ctx).append([int(t) for t in rng.integers(3, model.n_vocab, size=n)])
    return model.info, cap


@pytest.fixture(scope="module")
def yarn_path(tmp_path_factory):
    spec = TinySpec(arch="llama", n_layer=2, seed=3, yarn=(4.0, 256))
    return str(write_tiny_gguf(tmp_path_factory.mktemp("yarn") / "tiny-yarn.gguf", spec))


def same_rope(ours: np.ndarray, theirs: np.ndarray, n_pos: int) -> None:
    """The same ggml op: bit for bit on the CPU. On a GPU build llama.cpp may run a batch's RoPE on
    one backend and kvlite's kernel on another, whose f32 sin/cos reduce an angle theta with an
    error of ~theta * 2^-24 of the rotated value: up to 1e-4 at position 299 on Vulkan (llvmpipe).
    Held to 2e-7 per position of the largest |q|."""
    if cpu_arithmetic():
        np.testing.assert_array_equal(ours, theirs)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-7 * n_pos * np.abs(theirs).max())


@pytest.mark.backend
def test_rope_equals_llamacpp_at_every_position(tiny_path):
    info, cap = _captured(tiny_path, 300)
    for il in range(info.n_layer):
        q_pre, q = cap.get("q_pre", il), cap.get("q", il)
        same_rope(rope(info, q_pre, np.arange(300), il), q, 300)


@pytest.mark.backend
def test_rope_equals_llamacpp_with_yarn(yarn_path):
    info, cap = _captured(yarn_path, 700)  # well past the original 256-token context
    assert info.rope_scaling == "yarn" and info.rope_freq_scale == 0.25 and info.yarn_ext_factor == 1.0
    for il in range(info.n_layer):
        same_rope(rope(info, cap.get("q_pre", il), np.arange(700)), cap.get("q", il), 700)


@pytest.mark.backend
def test_llama3_frequency_factors_are_read_from_the_file(tiny_paths):
    """The llama3 fixture's rope_freqs.weight, as written, reaches ModelInfo (and through it the
    native RoPE and the twin: the two tests around this one run on that fixture too)."""
    from kvlite.models import read_model_info

    info = read_model_info(tiny_paths["llama3"])
    want = llama3_freq_factors(info.head_dim, info.rope_base)
    assert info.rope_freq_factors == tuple(float(x) for x in want)
    assert min(want) == 1.0 and max(want) == 8.0 and 1.0 < sorted(want)[4] < 8.0  # all three regimes
    assert read_model_info(tiny_paths["llama"]).rope_freq_factors is None


@pytest.mark.backend
def test_rope_matches_the_torch_twin(tiny_path):
    """Without scaling, ggml's RoPE is the textbook rotation. ggml builds the angles in f32 by
    repeated multiplication (theta_i = p * base^(-2i/D)), so the angle error grows ~ p * i * 6e-8:
    ~1e-4 rad at position 5000 on |q| ~ 10 vectors (1.2e-4 observed); 1e-3 leaves margin."""
    info, cap = _captured(tiny_path, 20)
    q_pre = cap.get("q_pre", 0)
    pos = np.array([0, 1, 7, 100, 999, 5000] + [3] * 14)
    got = rope(info, q_pre, pos)
    want = torch_rope(
        torch.from_numpy(q_pre).double(),
        torch.from_numpy(pos),
        info.layer_rope_base(0),
        info.rope_type,
        info.rope_freq_factors,
    )
    np.testing.assert_allclose(got, want.numpy(), atol=1e-3, rtol=0)


def test_proposals_layout(tiny_paths):
    info, cap = _captured(tiny_paths["llama"], 12)
    anchors = np.stack([cap.get("q_pre", il)[-2:] for il in range(info.n_layer)])  # S = 2: [L, 2, H, D]
    positions = [12, 13, 14, 15]
    props = proposals(info, anchors, positions, range(info.n_layer))
    assert props.shape == (info.n_layer, info.n_head, 2 * 4, info.head_dim)
    for il in range(info.n_layer):
        for s in range(2):
            for t, p in enumerate(positions):
                want = rope(info, anchors[il, s][None], [p], il)[0]  # [H, D]
                np.testing.assert_array_equal(props[il, :, s * 4 + t], want)


def test_spread_picks_evenly_from_the_first_to_the_last():
    from kvlite.scoring.proposals import spread

    assert spread(24, 6).tolist() == [0, 5, 9, 14, 18, 23]  # 0, 4.6, 9.2, 13.8, 18.4, 23 rounded
    assert spread(24, 1).tolist() == [0]
    assert spread(24, 2).tolist() == [0, 23]
    assert spread(5, None).tolist() == spread(5, 5).tolist() == spread(5, 9).tolist() == [0, 1, 2, 3, 4]
