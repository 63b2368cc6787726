"""The fixture writer's real-shape options (scripts/bench_shapes.py times random-weight files of real
model shapes): a vocabulary padded to a real size that text never reaches, and f16 matrices."""

from __future__ import annotations

import json

import gguf
import numpy as np
from conftest import run_cli

from kvlite.engine import Model
from kvlite.reference.tiny_gguf import TinySpec, vocabulary, write_tiny_gguf


def test_padded_vocabulary_and_f16_weights_load_and_run(tmp_path):
    spec = TinySpec(arch="llama", n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_vocab=5000, weights="f16")
    path = write_tiny_gguf(tmp_path / "shape.gguf", spec)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert types["output.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32  # norms stay f32, as converters write
    assert reader.tensors[[t.name for t in reader.tensors].index("output.weight")].shape.tolist() == [64, 5000]

    model = Model(path)
    assert model.n_vocab == 5000
    n_real = len(vocabulary()[0])
    tokens = model.tokenize("The quick brown fox and \u00e9t\u00e9.\n")
    assert tokens and max(tokens) < n_real  # the padding is never what text tokenizes to,
    assert max(model.tokenize("<unused7>", parse_special=False)) < n_real  # not even its own names as text

    proc = run_cli("generate", "-m", str(path), "-p", "abcdefghij" * 20, "-n", "4", "--json", "--policy", "snapkv",
                   "--budget", "64")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["generated_tokens"] >= 1 and out["cache"]["final_cells"] <= 64 + 4


def test_f32_fixtures_are_unchanged_by_the_shape_options(tmp_path):
    """The default spec draws the same numbers as before n_vocab and weights existed (the parity tests'
    fixtures, and any number computed from them, stay as they were)."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", TinySpec(n_layer=1, seed=3))
    reader = gguf.GGUFReader(str(path))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rng = np.random.default_rng(3)
    want = (0.3 * rng.standard_normal((len(vocabulary()[0]), TinySpec().n_embd))).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(emb.data), want)
