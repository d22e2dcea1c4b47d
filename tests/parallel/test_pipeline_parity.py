"""Pipeline parity: 3 AdamW steps of every schedule and of PP composed with FSDP/HSDP/TP/SP/AC,
compared with one process (loss, grad norm and every rank's updated weights). One launch per
world size; the model has 8 layers so that pp=4 with two stages per rank is possible."""

from __future__ import annotations

import pytest

from ndtrain.tools.verify import verify

TOL = 1e-5  # fp32, 3 AdamW steps: reduction order only; derived in conftest's parity_base docstring

WORLD2 = ["pp=2,pp_schedule=GPipe", "pp=2,pp_schedule=1F1B", "pp=2,pp_schedule=1F1B,ga=4,activation_checkpoint=full",
          "pp=2,pp_virtual_stages=2,pp_schedule=Interleaved1F1B", "pp=2,pp_virtual_stages=2,pp_schedule=InterleavedZeroBubble",
          "pp=2,pp_virtual_stages=2,pp_schedule=ZBVZeroBubble,activation_checkpoint=full", "pp=2,pp_virtual_stages=2,pp_schedule=DualPipeV",
          "pp=2,pp_virtual_stages=2,pp_schedule=ZBVZeroBubble,pp_microbatches=8"]
WORLD4 = ["pp=4,pp_schedule=GPipe", "pp=4,pp_schedule=1F1B", "pp=4,pp_schedule=1F1B,pp_split=llama3",
          "pp=4,pp_virtual_stages=2,pp_schedule=Interleaved1F1B", "pp=4,pp_virtual_stages=2,pp_schedule=Interleaved1F1B,ga=2",
          "pp=4,pp_virtual_stages=2,pp_schedule=InterleavedZeroBubble", "pp=4,pp_virtual_stages=2,pp_schedule=ZBVZeroBubble",
          "pp=4,pp_virtual_stages=2,pp_schedule=DualPipeV",
          "pp=2,dp_shard=2", "pp=2,dp_replicate=2", "pp=2,tp=2", "pp=2,tp=2,sequence_parallel=0,activation_checkpoint=full",
          "pp=2,pp_virtual_stages=2,dp_shard=2,pp_schedule=ZBVZeroBubble", "pp=2,pp_virtual_stages=2,tp=2,pp_schedule=Interleaved1F1B,ga=4"]
# Context parallel inside a pipeline (every stage gets the cp shard's global positions for RoPE)
# and the ZeRO stages a pipeline runs (it reduces gradients once per step: 1 and 3).
CP_ZERO4 = ["pp=2,cp=2", "pp=2,cp=2,pp_virtual_stages=2,pp_schedule=ZBVZeroBubble", "pp=2,cp=2,pp_virtual_stages=2,pp_schedule=Interleaved1F1B,ga=4",
            "pp=2,dp_shard=2,zero=1", "pp=2,dp_shard=2,zero=3,reshard_after_forward=0",
            "pp=2,pp_virtual_stages=2,dp_shard=2,zero=1,pp_schedule=DualPipeV"]
# Tied embeddings: the first and last stage each hold the weight, their gradients are summed.
TIED2 = ["pp=2", "pp=2,pp_virtual_stages=2,pp_schedule=ZBVZeroBubble"]
TIED4 = ["pp=4", "pp=4,pp_virtual_stages=2,pp_schedule=DualPipeV", "pp=2,tp=2", "pp=2,dp_shard=2,zero=1"]
WORLD8 = ["pp=2,dp_shard=2,tp=2", "pp=2,pp_virtual_stages=2,dp_shard=2,tp=2,pp_schedule=Interleaved1F1B"]


def _base(parity_base, clip: bool = False) -> dict:
    base = {k: dict(v) for k, v in parity_base.items()}
    base["model"]["n_layers"] = 8
    if clip:
        # Every step clips, so a wrong cross-stage grad norm would change the weights; the large
        # eps keeps the update proportional to the (clipped) gradient.
        base["optimizer"].update(grad_clip=0.05, eps=1e-3)
    return base


def _check(results, layouts):
    assert [r.layout for r in results] == layouts
    bad = [r for r in results if not (r.d_loss <= TOL and r.d_weight <= TOL and r.d_grad_norm <= TOL)]
    assert not bad, "\n".join(f"{r.layout}: Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e} "
                              f"grad-norm {r.d_grad_norm:.2e}" for r in bad)


@pytest.mark.timeout(300)
def test_pp2_every_schedule(parity_base):
    _, results = verify(_base(parity_base), WORLD2, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, WORLD2)


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_pp4_schedules_and_pp_with_fsdp_hsdp_tp_clipping(parity_base):
    ref, results = verify(_base(parity_base, clip=True), WORLD4, steps=3, tol_loss=TOL, tol_weight=TOL)
    assert min(ref["grad_norms"]) > 0.05 * 2  # clipping really acted on every step
    _check(results, WORLD4)


@pytest.mark.timeout(300)
def test_pp_with_moe_expert_parallel_aux_free(parity_base):
    """The aux-loss-free bias moves with each step's routing load: torch's shape-inference
    forward on a schedule's first step must not count as training tokens."""
    base = {k: dict(v) for k, v in parity_base.items()}
    base["model"] = {"preset": "debug-moe", "load_balance": "aux_free"}
    layouts = ["pp=2,dp_shard=2,ep=2", "pp=2,pp_virtual_stages=2,dp_shard=2,ep=2,pp_schedule=ZBVZeroBubble",
               "pp=2,cp=2,ep=2", "pp=2,pp_virtual_stages=2,cp=2,ep=2,zero=1,pp_schedule=DualPipeV"]  # pp x cp x ep, as plans propose
    _, results = verify(base, layouts, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, layouts)


@pytest.mark.timeout(300)
def test_cp_and_zero_stages_inside_a_pipeline(parity_base):
    _, results = verify(_base(parity_base), CP_ZERO4, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, CP_ZERO4)


@pytest.mark.timeout(300)
def test_tied_embeddings_across_stages(parity_base):
    base = _base(parity_base, clip=True)  # every step clips: the tied weight must count once in the norm
    base["model"]["tie_embeddings"] = True
    ref, results = verify(base, TIED2 + TIED4, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, TIED2 + TIED4)
    assert "output.weight" in ref["weights"] and "tok_embeddings.weight" in ref["weights"]


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_3d_pp_fsdp_tp_world8(parity_base):
    _, results = verify(_base(parity_base), WORLD8, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, WORLD8)
