"""Policy parameters are declared once (kvlite.policies.base.param) and everything else follows:
validation, the CLI flags, the eval-spec parser, the docs table; and the worked example of adding
a policy (K-norm) works end to end, with its torch twin."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np
import pytest
import torch

from kvlite.cli import build_parser
from kvlite.errors import KvliteError
from kvlite.eval.specs import parse_spec, policy_for
from kvlite.policies import ALL_PARAMS, POLICIES, KNorm, make_policy
from kvlite.reference.model import ReferenceModel
from kvlite.reference.scores import knorm
from kvlite.runner import Runner, RunSettings

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_field_is_declared(name):
    cls = POLICIES[name]
    assert set(cls.params()) == {f.name for f in dataclasses.fields(cls)}


def test_unknown_parameter_names_the_valid_ones():
    with pytest.raises(KvliteError, match=r"no parameter kernal: it takes .*pool_kernel \(--pool-kernel\)"):
        make_policy("echokv", kernal=7)
    with pytest.raises(KvliteError, match=r"policy snapkv has no parameter anchors \(--anchors\)"):
        make_policy("snapkv", budget=64, anchors=4)


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("snapkv", dict(pool_kernel=-1), "--pool-kernel must be >= 0, got -1"),
        ("knorm", dict(first_layer=-1), "--first-layer must be >= 0"),
        ("echokv", dict(anchors=0), "--anchors must be >= 1"),
        ("streaming", dict(mode="sliding"), "--mode must be one of prefill-end, chunked"),
        ("laq", dict(lookahead=float("nan")), "-T must be an integer"),
        ("cc", dict(min_gap=2.5), "--min-gap must be an integer"),
    ],
)
def test_declared_ranges_are_checked(name, params, message):
    with pytest.raises(KvliteError, match=message):
        make_policy(name, budget=64, **params)


def test_cli_flags_come_from_the_declarations():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    generate = sub.choices["generate"]
    flags = {s for a in generate._actions for s in a.option_strings}
    assert {p.flag for p in ALL_PARAMS.values()} <= flags
    assert "-T" in flags and "--first-layer" in flags
    args = generate.parse_args(["--policy", "knorm", "--budget", "64", "--first-layer", "1"])
    assert args.first_layer == 1 and args.lookahead is None


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"full"}))
def test_a_share_of_the_prompt_is_the_policy_at_its_cells(name):
    """budget="2%" of a 4,000-token prompt is the policy at 80 cells, the defaults worked out from
    the budget (H2O's window, the lookahead's workspace, EchoKV's pool kernel) included."""
    share = make_policy(name, budget="2%")
    assert share.share and share.resolve(4000) == make_policy(name, budget=80)
    assert make_policy(name, budget=" 12.50% ").budget == "12.5%"


@pytest.mark.parametrize("command", ["info", "generate", "chat", "serve", "eval"])
def test_every_commands_help_prints(command, capsys):
    """--help formats every flag's help (argparse reads a % there as a format)."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and (command == "info" or "--budget" in out)


def test_spec_parser_uses_aliases_flags_and_names():
    assert parse_spec("echokv(T=8,kernel=5,B1=256,S=4,aggregate=mean)")[1] == dict(
        lookahead=8, pool_kernel=5, workspace=256, anchors=4, aggregation="mean"
    )
    assert parse_spec("echokv(pool-kernel=5,pool_kernel=7)")[1] == {"pool_kernel": 7}
    assert parse_spec("knorm(first_layer=1,h=32,mode=chunked)")[1] == dict(first_layer=1, chunk=32, mode="chunked")
    with pytest.raises(KvliteError, match="has no parameter T: its parameters are"):
        parse_spec("snapkv(T=8)")
    with pytest.raises(KvliteError, match="wants an integer"):
        parse_spec("echokv(T=eight)")
    with pytest.raises(KvliteError, match="its --budgets axis"):
        policy_for("echokv(budget=2%)", 64)


def test_docs_table_is_generated_from_the_declarations():
    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_tables import render

    text = (ROOT / "docs" / "policies.md").read_text()
    assert render(text) == text, "docs/policies.md is stale: run scripts/docs_tables.py"


# -- the worked example: K-norm --------------------------------------------------------------------
# Tolerance: the tiny model's f32 weights and an f32 cache leave summation-order noise in the keys
# (tests/test_reference_parity.py holds them to 1e-4 per element); a norm over head_dim 16 moves by
# at most sqrt(16) * 1e-4, so 1e-3 is a safe bound and far below the spread of the scores.
ATOL_KNORM = 1e-3


@pytest.mark.parametrize("first_layer", [0, 1])
def test_knorm_matches_its_torch_twin(tiny_path, first_layer):
    from kvlite.engine import Model

    path = tiny_path
    model = Model(path)
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, model.n_vocab, size=120)]
    policy = KNorm(budget=40, first_layer=first_layer)
    runner = Runner(model, policy, RunSettings(n_ctx=256, chunk=64, type_k="f32", type_v="f32"))
    try:
        runner.feed(tokens)
        ev = runner.last_eviction
        assert ev is not None and np.array_equal(ev.positions, np.arange(120))
        ref = ReferenceModel(path)
        cache = ref.new_cache()
        ref.forward(tokens, range(len(tokens)), cache)
        layers = [il for il in ref.info.full_layers if il >= first_layer]  # gemma3: its global layers
        k = torch.stack([cache.k[il] for il in layers]).permute(0, 2, 1, 3)  # [L, Hkv, n, D]
        want = knorm(k).numpy()
        err = np.abs(ev.scores - want).max()
        print(f"knorm(first_layer={first_layer}) max err {err:.2e}, score spread {np.ptp(want):.2f}")
        assert err < ATOL_KNORM and np.ptp(want) > 100 * ATOL_KNORM
        assert np.array_equal(runner.cache.positions(), runner.cache.llama_positions(0))
        assert len(runner.cache.positions()) == 40
    finally:
        runner.close()


def test_knorm_first_layer_beyond_the_model(tiny_paths):
    from kvlite.engine import Model

    model = Model(tiny_paths["llama"])
    with pytest.raises(KvliteError, match="the model has 3 layers"):  # when the runner is made, before any work
        Runner(model, KNorm(budget=20, first_layer=9), RunSettings(n_ctx=256, chunk=64))


def test_hybrid_gives_each_part_its_own_pool_kernel():
    """The hybrid holds an EchoKV and a KVzip; --pool-kernel is the EchoKV part's (its rule: 13, 7
    under 128 cells), and the KVzip part keeps KVzip's 7 whatever it says."""
    for budget, kernel in ((64, 7), (256, 13)):
        h = make_policy("hybrid", budget=budget)
        assert (h.echokv.pool_kernel, h.kvzip.pool_kernel) == (kernel, 7)
    h = make_policy("hybrid", budget=256, pool_kernel=5, repeat_chunk=64, lookahead=8)
    assert (h.echokv.pool_kernel, h.kvzip.pool_kernel, h.kvzip.repeat_chunk, h.echokv.lookahead) == (5, 7, 64, 8)
