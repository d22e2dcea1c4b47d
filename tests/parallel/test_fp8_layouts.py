"""FP8 composed with every dimension (slow suite): fp8-vs-bf16 curves over 30 steps under FSDP x TP,
in one process with both recipes (test_fp8.py's LONG bounds: after 30 steps the runs have
decorrelated, so only gross defects stand out), and 3-step parity of fp8 layouts (HSDP, DDP,
ZeRO-2, TP/SP, CP, PP incl. a zero-bubble schedule, EP, activation checkpointing, CPU offload,
compile) against one fp32 process.

The 3-step tolerance is bf16's (verify's default for bf16, 2e-2): fp8 runs bf16 everywhere but
its GEMMs, and over 3 steps at lr 1e-3 the fp8 rounding stays below it (worst seen: 7.8e-3,
the grad norm at world 1). fp8 run for run equals no other layout to fp32 precision, so this
checks that each composition trains the same model, not the fp8 arithmetic itself; the curve
tests (here and in test_fp8.py) bound that."""

from __future__ import annotations

import pytest

from ndtrain.tools.verify import verify

FP8_TOL = 2e-2
WORLD2 = ["dp_shard=2,mixed_precision=fp8,fp8_recipe=rowwise", "dp_replicate=2,mixed_precision=fp8", "tp=2,mixed_precision=fp8,activation_checkpoint=selective",
          "dp_shard=2,zero=2,mixed_precision=fp8,ga=2", "dp_shard=2,mixed_precision=fp8,activation_checkpoint=full", "dp_shard=2,cpu_offload=true,mixed_precision=fp8"]
WORLD4 = ["tp=4,mixed_precision=fp8", "dp_replicate=2,dp_shard=2,mixed_precision=fp8", "dp_shard=2,tp=2,sequence_parallel=0,mixed_precision=fp8",
          "dp_shard=2,cp=2,mixed_precision=fp8", "pp=2,dp_shard=2,mixed_precision=fp8",
          "pp=2,dp_shard=2,mixed_precision=fp8,pp_schedule=ZBVZeroBubble,pp_virtual_stages=2,fp8_recipe=rowwise"]


def _check(results, layouts):
    assert sorted(r.layout for r in results) == sorted(layouts)
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(f"{r.layout}: Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e} "
                              f"grad-norm {r.d_grad_norm:.1e}" for r in bad)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fp8_composes_with_every_dimension(parity_base):
    layouts = WORLD2 + WORLD4
    _, results = verify(parity_base, layouts, steps=3, tol_loss=FP8_TOL, tol_weight=FP8_TOL)
    _check(results, layouts)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp8_with_experts_and_compile(parity_base):
    """Expert parallel (the experts' grouped GEMMs stay bf16; attention and dense layers run fp8)
    and torch.compile of fp8 blocks under FSDP (compiled in the forked ranks: a parent that
    compiled before forking leaves its children waiting on the parent's compile workers)."""
    moe = {k: dict(v) for k, v in parity_base.items()}
    moe["model"] = {"preset": "debug-moe"}
    layouts = ["dp_shard=2,ep=2,mixed_precision=fp8", "dp_shard=2,ep=2,tp=2,mixed_precision=fp8"]
    _, results = verify(moe, layouts, steps=3, tol_loss=FP8_TOL, tol_weight=FP8_TOL)
    _check(results, layouts)
    layouts = ["dp_shard=2,mixed_precision=fp8,compile=true,activation_checkpoint=full"]
    _, results = verify(parity_base, layouts, steps=3, tol_loss=FP8_TOL, tol_weight=FP8_TOL)
    _check(results, layouts)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 90 steps at world 4: ~2 min on a quiet machine, 12 min seen under load
def test_fp8_tracks_bf16_under_fsdp_x_tp(parity_base, hang_deadline):
    """World 4, dp_shard=2 x tp=2 with sequence parallel, both recipes, 30 steps."""
    from test_fp8 import LONG, _base, _check_curves

    from ndtrain.parallel.launch import run_ranks
    from ndtrain.tools.verify import _run_many, layout_config

    base = _base(parity_base, LONG)
    specs = ["dp_shard=2,tp=2,mixed_precision=bf16", "dp_shard=2,tp=2,mixed_precision=fp8", "dp_shard=2,tp=2,mixed_precision=fp8,fp8_recipe=rowwise"]
    bf16, tensorwise, rowwise = (r["losses"] for r in run_ranks(4, _run_many, [layout_config(base, s) for s in specs],
                                                                 LONG.steps, timeout_s=hang_deadline(120))[0])
    _check_curves(tensorwise, bf16, "FSDP x TP tensorwise", LONG)
    _check_curves(rowwise, bf16, "FSDP x TP rowwise", LONG)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2 x 30 fp8 steps: ~40 s here; minutes where _scaled_mm is emulated
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_tracks_bf16_in_one_process_30_steps(parity_base, recipe):
    from test_fp8 import LONG, _check_curves, one_process_curves

    fp8, bf16 = one_process_curves(parity_base, recipe, LONG)
    _check_curves(fp8, bf16, f"world 1 {recipe}, 30 steps", LONG)
