"""The rule behind `[parallel] compile_auto`: compile the blocks when the run's steps times the
predicted per-step saving exceed the cold compile time (planner/compile_choice.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ndtrain.layout import parse_layout
from ndtrain.model.config import ModelConfig, preset
from ndtrain.planner.compile_choice import block_kinds, compile_choice
from ndtrain.planner.hardware import UNMEASURED_CPU_COMPILE, from_profile
from ndtrain.planner.problem import make_problem

PEERS = ModelConfig(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768, vocab_size=2048)
CALIBRATED = {"description": "a calibrated CPU host (defaults for what it did not measure)"}


def peers_problem(profile: dict, precision: str = "fp32"):
    return make_problem(PEERS, 256, 8, 2, from_profile(profile, "test"), precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_rule_weighs_the_compile_against_the_run(precision):
    pb = peers_problem(CALIBRATED, precision)
    lay = parse_layout("dp_replicate=2,dp_shard=1,micro_batch=4", 2)
    d = compile_choice(pb, lay, 10)
    saved = d["eager_step_s"] - d["compiled_step_s"]
    # The blocks save the measured fraction of their own time; embedding, head, loss, the
    # all-reduce and the optimizer do not compile, so the step saves less than that fraction.
    fraction = UNMEASURED_CPU_COMPILE["saving"][precision]
    assert 0.5 * fraction < saved / d["eager_step_s"] < fraction
    assert d["compile_s"] == UNMEASURED_CPU_COMPILE["compile_s"]  # one kind of block
    assert d["breakeven_steps"] == math.ceil(d["compile_s"] / saved)
    n = d["breakeven_steps"]
    assert not compile_choice(pb, lay, n)["compile"] and compile_choice(pb, lay, n + 1)["compile"]
    assert not d["compile"] and "the run has 10" in d["description"]


def test_a_measured_compile_time_and_saving_replace_the_defaults():
    lay = parse_layout("dp_replicate=2,dp_shard=1,micro_batch=4", 2)
    slow = compile_choice(peers_problem({**CALIBRATED, "compile_s": 36.0}), lay, 1)
    base = compile_choice(peers_problem(CALIBRATED), lay, 1)
    assert slow["compile_s"] == 36.0 and slow["breakeven_steps"] in (2 * base["breakeven_steps"] - 1,
                                                                    2 * base["breakeven_steps"])
    none = compile_choice(peers_problem({**CALIBRATED, "compile_saving": {"fp32": 0.0}}), lay, 10**9)
    assert none["breakeven_steps"] is None and not none["compile"] and "no faster" in none["description"]


def test_what_cannot_be_priced_gets_no_decision():
    lay = parse_layout("dp_replicate=2,dp_shard=1,micro_batch=4", 2)
    assert compile_choice(peers_problem({}), lay, 10**6) is None  # uncalibrated CPU: no compile time known
    pb = peers_problem(CALIBRATED)
    # fully checkpointed TP blocks compile (parallel/compose.py checkpoints the compiled block)
    assert compile_choice(pb, parse_layout("tp=2,dp_shard=1,micro_batch=4,activation_checkpoint=full", 2), 10**6) is not None
    assert compile_choice(pb, parse_layout("dp_replicate=2,dp_shard=1,micro_batch=4,activation_checkpoint=every_n", 2), 10**6) is None
    # a schedule whose compiled blocks the runtime refuses: off, and why (not "cannot be priced")
    split_bwd = parse_layout("pp=2,dp_shard=1,micro_batch=1,pp_schedule=ZBVZeroBubble,pp_virtual_stages=2", 2)
    d = compile_choice(pb, split_bwd, 10**6)
    assert d["compile"] is False and d["breakeven_steps"] is None and d["compiled_step_s"] == d["eager_step_s"]
    assert d["description"].startswith("torch.compile off: ZBVZeroBubble runs the backward in separate")


def test_gpus_price_compile_as_fused_elementwise_kernels():
    """On a GPU the saving is the elementwise traffic fused kernels avoid (kappa_fused against
    kappa_eager); the compile time is the catalog's estimate."""
    pb = make_problem(preset("llama3-1b"), 2048, 8, 8, "h200", precision="bf16")
    lay = parse_layout("dp_shard=8,micro_batch=1", 8)
    d = compile_choice(pb, lay, 100)
    assert d["compiled_step_s"] < d["eager_step_s"] and d["compile_s"] == pb.hw.compile_s > 0
    assert not d["compile"] and compile_choice(pb, lay, d["breakeven_steps"] + 1)["compile"]


def test_dense_and_moe_blocks_compile_separately():
    moe = preset("debug-moe")  # a dense first layer, then MoE layers
    pb = make_problem(moe, 64, 8, 1, from_profile(CALIBRATED, "test"), precision="fp32")
    assert block_kinds(pb) == 2
    assert compile_choice(pb, parse_layout("dp_shard=1,micro_batch=8", 1), 1)["compile_s"] == 2 * pb.hw.compile_s
    assert block_kinds(dataclasses.replace(pb, cfg=preset("debug"))) == 1
