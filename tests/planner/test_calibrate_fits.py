"""How `ndtrain calibrate` turns what it timed in situ into the planner's collective fits."""

import pytest

from ndtrain.planner.comm import collective_time
from ndtrain.planner.hardware import from_profile
from ndtrain.calibrate.host_costs import SHAPES, fit_dp, layer_param_bytes


def _timed(per_byte: float, alpha: float) -> dict:
    """{"dim,seq": [layer, head]}: a plain layer of 1 ms plus `alpha + per_byte x layer bytes`."""
    return {f"{d},{s}": [1e-3 + alpha + per_byte * layer_param_bytes(d), 0.0] for d, s in SHAPES}


def test_zero3_reduce_scatter_is_priced_at_half_fsdps_all_reduce():
    """The runtime reduce-scatters through an all-to-all on Gloo (half an all-reduce's bytes): with
    FSDP2's replication (one blocking all-reduce per block) timed on the same ranks, ZeRO-3's
    reduce-scatter costs half that all-reduce and the rest of its extra is its two all-gathers.
    The DDP reducer (fp32 plain replication) overlaps the backward and gets a fit of its own,
    "all_reduce_ddp"."""
    plain = _timed(0.0, 0.0)
    ar, ag, ddp_ar = 4e-9, 1e-9, 2e-9  # seconds per byte of a layer's parameters
    replicated = _timed(ar, 2e-4)
    ddp = _timed(ddp_ar, 1e-4)
    zero3 = _timed(ar / 2 + 2 * ag, 1e-4 + 2 * 1e-4)
    fits = {**fit_dp(plain, replicated, "replicate", 2, 1.0), **fit_dp(plain, ddp, "ddp", 2, 1.0),
            **fit_dp(plain, zero3, "zero3", 2, 1.0, replicated)}
    hw = from_profile({"cores": 2, "dp_in_situ": {"2": fits}})
    n = layer_param_bytes(SHAPES[1][0])
    world2 = hw.for_world(2)
    # each adds to a layer what its run added: two ring hops of the fit
    assert collective_time(world2, "all_reduce", 2, 1, n) == pytest.approx(2e-4 + ar * n, rel=1e-6)
    assert collective_time(world2, "all_reduce_ddp", 2, 1, n) == pytest.approx(1e-4 + ddp_ar * n, rel=1e-6)
    assert collective_time(world2, "reduce_scatter", 2, 1, n) == pytest.approx(1e-4 + ar / 2 * n, rel=1e-6)
    assert collective_time(world2, "all_gather", 2, 1, n) == pytest.approx(1e-4 + ag * n, rel=1e-6)
    # without FSDP's replication timed the old even split stands: three equal collectives
    even = fit_dp(plain, zero3, "zero3", 2, 1.0)
    assert even["all_gather"] == even["reduce_scatter"]


def test_fp32_replication_is_priced_on_the_ddp_reducer_bf16_on_fsdp():
    """The runtime runs fp32 plain replication on torch's DDP reducer and bf16 on FSDP2
    (Layout.on_ddp_reducer): the planner prices each with the all-reduce its runtime path issues."""
    from ndtrain.layout import Layout
    from ndtrain.model.config import preset
    from ndtrain.planner.api import make_problem
    from ndtrain.planner.timing import dp_comm

    cheap, dear = {"alpha": 1e-5, "beta": 50e9}, {"alpha": 1e-3, "beta": 0.2e9}
    hw = from_profile({"cores": 2, "dp_in_situ": {"2": {"all_reduce": dear, "all_reduce_ddp": cheap}}})
    grads = {}
    for mp in ("fp32", "bf16"):
        pb = make_problem(preset("debug"), 256, 8, 2, hw, precision=mp)
        lay = Layout(dp_replicate=2, micro_batch=4)  # the problem holds the precision
        grads[mp] = dp_comm(pb, lay, pb.shape.layers)[2]
    assert Layout(dp_replicate=2).on_ddp_reducer() and not Layout(dp_replicate=2, mixed_precision="bf16").on_ddp_reducer()
    assert not Layout(dp_replicate=2).on_ddp_reducer(moe=True)
    # bf16 reduces fp32 gradients too (FSDP's reduce dtype): same bytes, the blocking fit costs more
    assert grads["fp32"] * 5 < grads["bf16"]


def test_optimizer_is_timed_as_the_trainer_runs_it(monkeypatch):
    """The trainer's default AdamW is the fused one (half foreach's time on this CPU): calibration
    must time that one, or the planner overprices replicated (DDP) training ~6x."""
    import torch

    from ndtrain.config import OptimizerConfig
    from ndtrain.calibrate.host_costs import optimizer_seconds_per_param

    seen = []
    real = torch.optim.AdamW

    def recording(params, **kw):
        seen.append(kw)
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    assert optimizer_seconds_per_param(params=1 << 12, tensors=2, reps=1) > 0
    assert OptimizerConfig().implementation == "fused" and seen and seen[0].get("fused") is True


def test_bf16_layers_get_their_own_gemm_efficiency():
    """mm_eff is fitted on the calibration's plain layer; bf16 gets its own, from the layer run in
    bf16 (its norms, RoPE, CPU attention and casts stay fp32, so the matmul peak's ratio
    overstates its speed-up): with each fitted, the time model gives back each measured layer."""
    from ndtrain.layout import Layout
    from ndtrain.planner.problem import make_problem
    from ndtrain.planner.layer import layer_costs
    from ndtrain.calibrate.cpu import fit_mm_eff
    from ndtrain.calibrate.host_costs import BATCH, _config

    dim, seq = SHAPES[-1]
    prof = {"cores": 2, "matmul": {"fp32_1thread": 100e9, "bf16_1thread": 220e9},
            "attention": {"fp32": {"256": 30e9}, "bf16": {"256": 30e9}},
            "host_s": {"layer": 1e-3, "head": 5e-4,
                       "measured": {f"{dim},{seq}": [25e-3, 0.0]}, "measured_bf16": {f"{dim},{seq}": [18e-3, 0.0]}}}
    eff = {"fp32": fit_mm_eff(prof), "bf16": fit_mm_eff(prof, "bf16")}
    assert 0.25 < eff["bf16"] < eff["fp32"] < 1.5  # 2.2x the peak, 1.4x the layer: less of the peak
    hw = from_profile({**prof, "mm_eff": eff["fp32"], "mm_eff_bf16": eff["bf16"]})
    for precision, measured in (("fp32", 25e-3), ("bf16", 18e-3)):
        pb = make_problem(_config(4, dim), seq, BATCH, 1, hw, precision=precision)
        assert layer_costs(pb, Layout(dp_shard=1, micro_batch=BATCH))["compute"] == pytest.approx(measured, rel=1e-6)
    # A profile from before the bf16 layer was timed: one efficiency for both
    old = from_profile({**prof, "mm_eff": eff["fp32"]})
    assert old.cpu_mm_eff("bf16") == old.cpu_mm_eff("fp32") == eff["fp32"]
