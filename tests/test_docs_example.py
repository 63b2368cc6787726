"""docs/policies.md's "Adding a policy" example, run as written: the code block is executed, and the
policy it defines evicts on the tiny f32 llama fixture. The cells it keeps must be the ones its
score ranks highest, computed apart from kvlite: key norms of the torch reference model's own keys
(kvlite.reference.model), not of llama.cpp's cache."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import numpy as np
import pytest

from kvlite.policies import POLICIES, Policy
from kvlite.runner import Runner, RunSettings

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "policies.md"
# The tiny model's f32 weights and an f32 cache leave summation-order noise in the keys
# (tests/test_policy_params.py bounds a key-norm score by 1e-3); the kept set is only compared
# where the cut between kept and evicted scores is wider than that.
ATOL = 1e-3


def example_source() -> str:
    """The first python block of the section "## Adding a policy"."""
    text = DOC.read_text()
    section = text.split("\n## Adding a policy\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/policies.md: no python block under 'Adding a policy'"
    return blocks[0]


def example_policy() -> type[Policy]:
    """Run the block as a module of its own (dataclasses looks its class's module up in sys.modules)."""
    module = types.ModuleType("docs_policies_example")
    sys.modules[module.__name__] = module
    exec(compile(example_source(), str(DOC), "exec"), module.__dict__)
    classes = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Policy) and v is not Policy]
    assert len(classes) == 1, f"the example should define one policy, got {classes}"
    return classes[0]


def test_example_declares_what_the_shipped_policy_does():
    cls = example_policy()
    shipped = POLICIES[cls.name]
    assert cls.params() == shipped.params()  # the same flags, help and ranges as `--policy knorm`


@pytest.mark.parametrize("first_layer", [0, 1])
def test_example_evicts_to_its_highest_scores(tiny_paths, first_layer):
    import torch

    from kvlite.engine import Model
    from kvlite.reference.model import ReferenceModel

    path = tiny_paths["llama"]
    model = Model(path)
    tokens = [int(t) for t in np.random.default_rng(7).integers(3, model.n_vocab, size=120)]
    policy = example_policy()(budget=40, sinks=4, first_layer=first_layer)
    policy.validate()
    runner = Runner(model, policy, RunSettings(n_ctx=256, chunk=64, type_k="f32", type_v="f32"))
    try:
        assert runner.feed(tokens)
        kept = runner.cache.positions()
        ev = runner.last_eviction
    finally:
        runner.close()

    # The same score, from the torch reference's keys: minus the L2 norm, averaged over layers from
    # first_layer and over KV heads.
    ref = ReferenceModel(path)
    cache = ref.new_cache()
    ref.forward(tokens, range(len(tokens)), cache)
    layers = [il for il in ref.info.full_layers if il >= first_layer]
    k = torch.stack([cache.k[il] for il in layers]).permute(0, 2, 1, 3)  # [L, Hkv, n, D]
    want = -torch.linalg.vector_norm(k.double(), dim=-1).mean(dim=(0, 1)).numpy()
    assert ev is not None and np.abs(ev.scores - want).max() < ATOL

    # Kept: the 4 sinks, the last token, and the 35 highest of the others by the reference score.
    protected = set(range(4)) | {119}
    free = np.array([p for p in range(120) if p not in protected])
    ranked = free[np.argsort(-want[free], kind="stable")]
    room = 40 - len(protected)
    cut = np.sort(want[free])[::-1]
    assert cut[room - 1] - cut[room] > ATOL, "the cut is a near tie: pick another seed"
    assert kept.tolist() == sorted(protected | set(ranked[:room].tolist()))
    assert kept.tolist() != sorted(protected | set(ranked[-room:].tolist()))  # the sign matters
