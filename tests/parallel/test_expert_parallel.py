"""Expert-parallel parity: 3 AdamW steps of the debug-moe model in each layout vs one process.
Same routing and the same loss, expert weights and aux-free biases, to fp32 tolerance.

One launch per world size and base config (verify groups layouts by world size)."""

from __future__ import annotations

import importlib.util

import pytest
from expert_checkpoint import train_save_continue

from ndtrain.tools.verify import verify

TOL = 1e-5
# Cross-feature layouts join the same launches when those features are present.
HAS_CP = importlib.util.find_spec("ndtrain.parallel.context") is not None
HAS_PP = importlib.util.find_spec("ndtrain.parallel.pipeline") is not None


def _moe_base(parity_base, **model):
    base = {k: dict(v) for k, v in parity_base.items()}
    base["model"] = {"preset": "debug-moe", **model}
    return base


def _check(results, layouts):
    assert sorted(r.layout for r in results) == sorted(layouts)
    failures = [r for r in results if not (r.d_loss <= TOL and r.d_weight <= TOL)]
    assert not failures, "\n".join(f"{r.layout}: Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e}" for r in failures)
    worst = max(results, key=lambda r: r.d_grad_norm)
    # fp32 sum of positive squares, reassociated: ~log2(n) x 2^-24 ~ 1e-6 relative (as in test_parity.py); 10x that.
    assert worst.d_grad_norm <= 1e-5, f"{worst.layout}: grad-norm relative error {worst.d_grad_norm:.2e}"


@pytest.mark.timeout(300)
def test_expert_parallel_parity_aux_loss(parity_base):
    """Sequence-wise aux loss, no dropping: ep=2, ep=4, ep=2 x 2 FSDP shards of the experts
    (with accumulation), ep=2 under HSDP; with cp (the aux statistics of a sequence split over
    ranks) and pp (the aux loss on a stage without the training loss) when present."""
    layouts = ["dp_shard=2,ep=2", "dp_shard=4,ep=4", "dp_shard=4,ep=2,ga=2", "dp_replicate=2,dp_shard=2,ep=2"]
    layouts += ["cp=2,ep=2"] if HAS_CP else []
    layouts += ["pp=2,dp_shard=2,ep=2"] if HAS_PP else []
    ref, results = verify(_moe_base(parity_base), layouts, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, layouts)
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_expert_parallel_parity_capacity_and_aux_free(parity_base):
    """Capacity dropping with the aux-loss-free bias (the biases are buffers in the compared
    state): ep=2 with full and selective recompute, ep=4, and ep=2 with tensor parallel (tp=2)."""
    layouts = ["dp_shard=2,ep=2,activation_checkpoint=full", "dp_shard=4,ep=4", "dp_shard=2,ep=2,tp=2", "dp_shard=2,ep=2,activation_checkpoint=selective",
               "dp_shard=4,ep=2,tp=1,activation_checkpoint=selective,zero=1"]
    base = _moe_base(parity_base, capacity_factor=1.0, load_balance="aux_free")
    ref, results = verify(base, layouts, steps=3, tol_loss=TOL, tol_weight=TOL)
    _check(results, layouts)
    biases = [w for name, w in ref["weights"].items() if name.endswith("expert_bias")]
    assert len(biases) == 3 and all(b.abs().max() > 0 for b in biases)  # the bias update ran


@pytest.mark.timeout(300)
def test_expert_parallel_checkpoint_resumes_in_one_process(parity_base, tmp_path, hang_deadline):
    """Experts sharded over ep (and their aux-free biases) reshard into a single process."""
    from ndtrain.config import load_config
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.train.trainer import Trainer

    base = _moe_base(parity_base, load_balance="aux_free", aux_free_update_rate=0.01)
    base["train"].update(val_interval=0, sample_tokens=0)
    reference, _ = run_ranks(2, train_save_continue, base, str(tmp_path), 2, timeout_s=hang_deadline(120))[0]
    cfg = load_config(None, base)
    trainer = Trainer(cfg, run_dir=None, log=False)
    ckpt = trainer.checkpointer(tmp_path, cfg)
    ckpt.resume("auto")
    assert trainer.step == 2
    assert any(m.expert_bias.abs().max() > 0 for _, m in trainer.state.moe)
    resumed = [trainer.train_step().loss for _ in range(2)]
    ckpt.finish()
    trainer.close()
    assert max(abs(a - b) for a, b in zip(resumed, reference)) <= TOL
