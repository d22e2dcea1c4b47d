"""How `ndtrain calibrate` turns what it timed in situ into the planner's collective fits."""

import pytest

from ndtrain.planner.comm import collective_time
from ndtrain.planner.hardware import from_profile
from ndtrain.tools.calibrate_host import SHAPES, fit_dp, layer_param_bytes


def _timed(per_byte: float, alpha: float) -> dict:
    """{"dim,seq": [layer, head]}: a plain layer of 1 ms plus `alpha + per_byte x layer bytes`."""
    return {f"{d},{s}": [1e-3 + alpha + per_byte * layer_param_bytes(d), 0.0] for d, s in SHAPES}


def test_zero3_reduce_scatter_is_priced_as_fsdps_all_reduce():
    """Gloo runs a reduce-scatter as a full all-reduce: with FSDP2's replication (one blocking
    all-reduce per block) timed on the same ranks, ZeRO-3's extra minus that is its two
    all-gathers, and its reduce-scatter costs that all-reduce. The all-reduce fit itself is the
    DDP reducer's (what plain replication runs on), which overlaps the backward: cheaper."""
    plain = _timed(0.0, 0.0)
    ar, ag, ddp_ar = 4e-9, 1e-9, 2e-9  # seconds per byte of a layer's parameters
    replicated = _timed(ar, 2e-4)
    ddp = _timed(ddp_ar, 1e-4)
    zero3 = _timed(ar + 2 * ag, 2e-4 + 2 * 1e-4)
    assert fit_dp(plain, replicated, "replicate", 2, 1.0) == {}
    fits = {**fit_dp(plain, ddp, "ddp", 2, 1.0), **fit_dp(plain, zero3, "zero3", 2, 1.0, replicated)}
    hw = from_profile({"cores": 2, "dp_in_situ": {"2": fits}})
    n = layer_param_bytes(SHAPES[1][0])
    world2 = hw.for_world(2)
    # DDP's all-reduce adds what the DDP run added to a layer: two ring hops of the fit
    assert collective_time(world2, "all_reduce", 2, 1, n) == pytest.approx(1e-4 + ddp_ar * n, rel=1e-6)
    assert collective_time(world2, "reduce_scatter", 2, 1, n) == pytest.approx(2e-4 + ar * n, rel=1e-6)
    assert collective_time(world2, "all_gather", 2, 1, n) == pytest.approx(1e-4 + ag * n, rel=1e-6)
    # without FSDP's replication timed the old even split stands: three equal collectives
    even = fit_dp(plain, zero3, "zero3", 2, 1.0)
    assert even["all_gather"] == even["reduce_scatter"]


def test_optimizer_is_timed_as_the_trainer_runs_it(monkeypatch):
    """The trainer's default AdamW is the fused one (half foreach's time on this CPU): calibration
    must time that one, or the planner overprices replicated (DDP) training ~6x."""
    import torch

    from ndtrain.config import OptimizerConfig
    from ndtrain.tools.calibrate_host import optimizer_seconds_per_param

    seen = []
    real = torch.optim.AdamW

    def recording(params, **kw):
        seen.append(kw)
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    assert optimizer_seconds_per_param(params=1 << 12, tensors=2, reps=1) > 0
    assert OptimizerConfig().implementation == "fused" and seen and seen[0].get("fused") is True
