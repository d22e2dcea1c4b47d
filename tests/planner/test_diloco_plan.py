"""`ndtrain plan --replicas-across`: per-step sync vs DiLoCo across sites (planner/diloco.py)."""

from __future__ import annotations

import json

import pytest

from ndtrain.cli import main as cli
from ndtrain.errors import NdtrainError
from ndtrain.model.config import preset
from ndtrain.planner import diloco
from ndtrain.layout import parse_layout
from ndtrain.planner.problem import make_problem


def test_parsing():
    assert diloco.parse_bandwidth("10Gbit") == diloco.parse_bandwidth("10 Gbps") == 1.25e9
    assert diloco.parse_bandwidth("1.25GB/s") == 1.25e9
    assert diloco.parse_across("400Mbit,50ms") == (5e7, 0.05)
    assert diloco.parse_across("1GB")[1] == 0.01
    v = diloco.parse_variants("8,32:4:1,64:2:0:bf16")
    assert [(x.inner_steps, x.fragments, x.overlap, x.outer_bytes) for x in v] == [(8, 1, 0, 4), (32, 4, 1, 4), (64, 2, 0, 2)]
    for bad in ("fast", "10Gbit,soon"):
        with pytest.raises(NdtrainError, match="--replicas-across"):
            diloco.parse_across(bad)
    for bad in ("x", "8:a", "8:2:1:fp16"):
        with pytest.raises(NdtrainError, match="--diloco"):
            diloco.parse_variants(bad)


@pytest.fixture(scope="module")
def setup():
    pb = make_problem(preset("llama3-8b"), 8192, 512, 64, "h100")
    lay = parse_layout("tp=8,dp_replicate=2,dp_shard=4,micro_batch=1,activation_checkpoint=selective", 64)
    return pb, lay, diloco.replica_prediction(pb, lay)


def test_model_limits(setup):
    pb, lay, inner = setup
    variants = diloco.parse_variants("8,32,32:4:1")
    slow = diloco.step_times(pb, inner, 2, 1.25e8, 0.02, variants)  # 1 Gbit/s
    fast = diloco.step_times(pb, inner, 2, 1e13, 1e-6, variants)  # effectively free
    sync, h8, h32, stream = slow
    # Bytes across sites fall by H (fp32 outer gradient vs fp32 gradients).
    assert sync["bytes_per_step"] / h8["bytes_per_step"] == pytest.approx(8)
    assert sync["bytes_per_step"] / h32["bytes_per_step"] == pytest.approx(32)
    # On a slow link per-step sync is communication-bound; DiLoCo amortises; streaming hides more.
    assert sync["step_s"] > 5 * h8["step_s"] and h8["step_s"] > h32["step_s"] > stream["step_s"] >= inner.step_time
    # On a free link nothing is gained: every variant costs the replica's own step.
    assert all(row["step_s"] == pytest.approx(inner.step_time, rel=1e-3) for row in fast)


def test_variants_run_the_layout_rule(setup):
    """The settings the trainer would refuse are refused by the planner too, by the same rule."""
    pb, lay, _ = setup
    for bad, key in (("0", "diloco_inner_steps"), ("8:3", "diloco_inner_steps=8"), ("8:2:4", "diloco_overlap_steps")):
        with pytest.raises(NdtrainError, match=key):
            diloco.across_report(pb, lay, 1.25e9, 0.01, diloco.parse_variants(bad))


def test_pays_below_is_the_break_even(setup):
    pb, lay, inner = setup
    v = diloco.Variant(32)
    bw = diloco.pays_below(pb, inner, 2, 0.02, v)
    sync, dl = diloco.step_times(pb, inner, 2, bw, 0.02, [v])
    assert sync["step_s"] / dl["step_s"] == pytest.approx(1 + diloco.PAYS_MARGIN, rel=1e-3)
    slower = diloco.step_times(pb, inner, 2, bw / 2, 0.02, [v])
    assert slower[0]["step_s"] / slower[1]["step_s"] > 1 + diloco.PAYS_MARGIN
    # H=1 synchronises (parameters) every step: never better than sync by the margin.
    assert diloco.pays_below(pb, inner, 2, 0.02, diloco.Variant(1)) is None


def test_cli(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--seq", "8192", "--global-batch", "512",
            "--layout", "tp=8,dp_replicate=2,dp_shard=4,micro_batch=1,activation_checkpoint=selective", "--replicas-across", "10Gbit,30ms"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "per-step sync" in out and "DiLoCo H=32" in out and "pays below" in out
    assert cli(args + ["--json", "--diloco", "16"]) == 0
    rep = json.loads(capsys.readouterr().out)["replicas_across"]
    assert [r["name"] for r in rep["rows"]] == ["per-step sync", "DiLoCo H=16"]
    assert rep["rows"][1]["speedup"] > 1
    assert cli(args[:-4] + ["--layout", "tp=8,dp_shard=8,micro_batch=1", "--replicas-across", "10Gbit"]) == 2
    err = capsys.readouterr().err.strip()
    assert "dp_replicate >= 2" in err and "\n" not in err
