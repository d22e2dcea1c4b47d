"""Layout parity matrix: 3 AdamW steps in each layout vs one process, same weights and data.

One launch per world size checks every layout of that size (a process group costs seconds)."""

from __future__ import annotations

import pytest

from ndtrain.tools.verify import verify

FP32_TOL = 1e-5  # fp32, 3 AdamW steps: reduction order only; derived in conftest's parity_base docstring
BF16_TOL = 1e-2  # bf16 parameters carry ~3 significant digits; 3 steps stay well inside 1e-2

WORLD2 = ["dp_replicate=2", "dp_shard=2", "tp=2", "tp=2,sequence_parallel=0"]
WORLD4 = ["dp_shard=4", "dp_replicate=2,dp_shard=2", "tp=4", "dp_shard=2,tp=2", "dp_shard=2,tp=2,sequence_parallel=0"]
VARIANTS = ["", ",ga=2", ",activation_checkpoint=full"]
# ZeRO stages in the paper's sense (the trainer's accumulation differs per stage, so ga=2 too):
# 1 optimizer state sharded, 2 also gradients, 3 also parameters (and 3 keeping them gathered).
ZERO2 = ["dp_shard=2,zero=1", "dp_shard=2,zero=1,ga=2", "dp_shard=2,zero=2", "dp_shard=2,zero=2,ga=2",
         "dp_shard=2,zero=3,reshard_after_forward=0,ga=2"]
ZERO4 = ["dp_replicate=2,dp_shard=2,zero=1,ga=2", "dp_shard=2,tp=2,zero=1", "dp_shard=2,cp=2,zero=2,ga=2",
         "cp=2,zero=1"]
EXTRA2 = ["dp_shard=2,cpu_offload=true", "tp=2,activation_checkpoint=selective", "dp_shard=2,activation_checkpoint=every_n,ga=2"]
EXTRA4 = ["dp_shard=2,tp=2,zero=2,activation_checkpoint=selective", "dp_replicate=2,tp=2,sequence_parallel=0,ga=2"]
BF16 = ["mixed_precision=bf16", "dp_shard=2,mixed_precision=bf16", "dp_replicate=2,mixed_precision=bf16,ga=2", "dp_shard=2,tp=2,mixed_precision=bf16", "dp_shard=2,zero=1,mixed_precision=bf16,ga=2",
        "dp_shard=2,zero=2,mixed_precision=bf16"]


def _check(results, tol):
    failures = [r for r in results if not (r.d_loss <= tol and r.d_weight <= tol and r.d_grad_norm <= tol and r.passed)]
    assert not failures, "\n".join(f"{r.layout}: Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e} "
                                    f"grad-norm {r.d_grad_norm:.1e}" for r in failures)


ALL_FP32 = [base + v for base in WORLD2 + WORLD4 for v in VARIANTS] + ZERO2 + ZERO4 + EXTRA2 + EXTRA4
# The default suite's share of the matrix: every base layout once, accumulation and full
# recomputation on one base each, every ZeRO stage at world 2, and each mechanism of the world-4
# rows once. The rest (the same mechanisms on the other bases) runs under `make test-heavy` and in CI.
DEFAULT_FP32 = (WORLD2 + WORLD4 + ["dp_shard=2,ga=2", "dp_shard=2,tp=2,activation_checkpoint=full"] + ZERO2
                + ["dp_shard=2,tp=2,zero=1", "dp_shard=2,cp=2,zero=2,ga=2"] + EXTRA2 + EXTRA4[:1])


def test_default_matrix_is_a_subset_of_the_full_one():
    assert set(DEFAULT_FP32) < set(ALL_FP32) and len(set(DEFAULT_FP32)) == len(DEFAULT_FP32)


@pytest.mark.timeout(600)
def test_fp32_layout_matrix(parity_base):
    _check_fp32(parity_base, DEFAULT_FP32)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_fp32_layout_matrix_rest(parity_base):
    _check_fp32(parity_base, [lay for lay in ALL_FP32 if lay not in DEFAULT_FP32])


def _check_fp32(parity_base, layouts):
    _, results = verify(parity_base, layouts, steps=3, tol_loss=FP32_TOL, tol_weight=FP32_TOL)
    assert len(results) == len(layouts)
    _check(results, FP32_TOL)
    # Grad norms (what clipping uses) agree across every layout, mixed meshes included.
    worst = max(results, key=lambda r: r.d_grad_norm)
    # A sum of ~2e5 positive squares: reassociating torch's blocked sums moves it by ~log2(n) x 2^-24 ~ 1e-6
    # relative, plus the gradients' own reduction-order noise; 1e-5 is ~10x that.
    assert worst.d_grad_norm <= 1e-5, f"{worst.layout}: grad-norm relative error {worst.d_grad_norm:.2e}"


@pytest.mark.timeout(300)
def test_clipping_active_layouts_agree(parity_base):
    """A tiny clip threshold makes every step clip, so a wrong norm would change the weights."""
    base = {k: dict(v) for k, v in parity_base.items()}
    base["optimizer"]["grad_clip"] = 0.05
    base["optimizer"]["eps"] = 1e-3  # large eps: the update scales with the clipped gradient
    _, results = verify(base, ["dp_shard=2,tp=2,sequence_parallel=0", "tp=2"], steps=3, tol_loss=FP32_TOL, tol_weight=FP32_TOL)
    _check(results, FP32_TOL)


@pytest.mark.timeout(300)
def test_bf16_mixed_precision(parity_base):
    _, results = verify(parity_base, BF16, steps=3, tol_loss=BF16_TOL, tol_weight=BF16_TOL)
    _check(results, BF16_TOL)
    # bf16 really ran: it cannot match fp32 as closely as an fp32 layout does.
    assert all(r.d_weight > FP32_TOL for r in results)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_blocks_match_eager(parity_base):
    """torch.compile per block (cold compiles take tens of seconds on 2 cores: slow suite), also
    under DDP, what the defaults choose for small models on few ranks."""
    _, results = verify(parity_base, ["compile=true", "dp_shard=2,compile=true,activation_checkpoint=full",
                                      "dp_replicate=2,dp_shard=1,compile=true"], steps=3,
                        tol_loss=FP32_TOL, tol_weight=FP32_TOL)
    _check(results, FP32_TOL)
