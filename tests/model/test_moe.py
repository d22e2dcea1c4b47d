"""Mixture of experts, single process: the grouped module against a per-token reference,
layout-independent routing, the auxiliary loss's gradient, aux-loss-free balancing, metrics,
parameter counts and config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import load_config
from ndtrain.errors import ConfigError
from ndtrain.model.config import num_params, preset, replace
from ndtrain.model.moe import MoE, end_step
from ndtrain.parallel import dims as pdims


def _moe(seed: int = 0, **changes) -> MoE:
    cfg = replace(preset("debug-moe"), **changes)
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definitions."""
    b, s, d = x.shape
    e, k = moe.n_experts, moe.top_k
    logits = x.reshape(-1, d) @ moe.router.weight.t()
    scores = logits.softmax(-1) if moe.router_kind == "softmax" else logits.sigmoid()
    choice = scores + moe.expert_bias if moe.load_balance == "aux_free" else scores
    top = choice.topk(k, -1).indices.view(b, s, k)
    weights = scores.view(b, s, e).gather(-1, top)
    if k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    keep = torch.ones(b, s, k, dtype=torch.bool)
    if moe.capacity_factor > 0:
        cap = math.ceil(moe.capacity_factor * s * k / e)
        for seq in range(b):
            used = [0] * e
            for j in range(k):  # first choices of every token before any second choice
                for t in range(s):
                    ex = int(top[seq, t, j])
                    keep[seq, t, j] = used[ex] < cap
                    used[ex] += 1
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for seq in range(b):
        for t in range(s):
            acc = torch.zeros(d)
            for j in range(k):
                if keep[seq, t, j]:
                    ex = int(top[seq, t, j])
                    xt = x[seq, t]
                    acc = acc + weights[seq, t, j] * ((F.silu(xt @ w1[ex]) * (xt @ w3[ex])) @ w2[ex])
            rows.append(acc)
    out = torch.stack(rows).view(b, s, d)
    return out + moe.shared_experts(x) if moe.shared_experts is not None else out


@pytest.mark.parametrize("router,capacity", [("softmax", 0.0), ("sigmoid", 0.0), ("softmax", 0.5), ("sigmoid", 1.0)])
def test_grouped_moe_matches_per_token_reference(router, capacity):
    moe = _moe(router=router, capacity_factor=capacity, load_balance="none")
    x = torch.randn(3, 10, 64, requires_grad=True)
    out = moe(x)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = _reference(moe, x_ref)
    # fp32, the same products summed in another order (grouped GEMM vs per token): <= depth x 2^-24 ~ 1e-5
    # relative for the 64-192-term sums here.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *moe.parameters()], g)
    grads_ref = torch.autograd.grad(ref, [x_ref, *moe.parameters()], g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # weight grads sum over all 30 tokens too: 10x the depth


def test_capacity_drops_lowest_priority_assignments():
    moe = _moe(capacity_factor=0.5, load_balance="none")
    x = torch.randn(2, 16, 64)
    probs, top, _ = moe.route(x.reshape(-1, 64))
    keep = moe.keep_mask(top, 2, 16)
    cap = moe.capacity(16)
    assert cap == 2 and not keep.all()
    per_seq = top.view(2, 16, 2)
    for seq in range(2):
        kept = per_seq[seq][keep.view(2, 16, 2)[seq]]
        assert torch.bincount(kept, minlength=8).max() <= cap


def test_routing_is_independent_of_batch_composition():
    """The same sequence gets the same output whatever else shares its (micro-)batch or rank."""
    moe = _moe(capacity_factor=0.75, load_balance="aux_free").eval()
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
        x = torch.randn(6, 12, 64)
        whole = moe(x)
        splits = [x[:1], x[1:4], x[4:]]
        pieces = torch.cat([moe(part) for part in splits])

        def decisions(part):
            _, top, _ = moe.route(part.reshape(-1, 64))
            return top, moe.keep_mask(top, part.shape[0], part.shape[1])

        top, keep = decisions(x)
        assert not keep.all()  # some assignments really are dropped
        assert torch.equal(torch.cat([decisions(p)[0] for p in splits]), top)
        assert torch.equal(torch.cat([decisions(p)[1] for p in splits]), keep)
    # Only the matmuls' row blocking differs: fp32 rounding, relative to the output's scale.
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))


def test_aux_loss_gradient_equals_adding_it_to_the_loss():
    coef = 0.3
    moe = _moe(load_balance="aux_loss", aux_loss_coef=coef)
    explicit = _moe(load_balance="none")
    explicit.load_state_dict(moe.state_dict())
    x = torch.randn(4, 8, 64)
    g = torch.randn(4, 8, 64)
    (moe(x) * g).sum().backward()
    out = explicit(x)
    probs, top, _ = explicit.route(x.reshape(-1, 64))
    aux_mean = explicit.sequence_balance(probs, top, 4, 8) / 4
    ((out * g).sum() + coef * aux_mean).backward()
    # fp32, the aux term's gradient reaches the router by two orders of summation; a sum over 32 tokens x 64 dims.
    torch.testing.assert_close(moe.router.weight.grad, explicit.router.weight.grad, rtol=1e-4, atol=1e-6)
    # The aux term really contributes: without it the router gradient differs.
    plain = _moe(load_balance="none")
    plain.load_state_dict(moe.state_dict())
    (plain(x) * g).sum().backward()
    assert (plain.router.weight.grad - moe.router.weight.grad).abs().max() > 1e-4
    assert 0.5 < float(aux_mean.detach()) < 8.0  # 1.0 when perfectly balanced


def _skewed_imbalance(load_balance: str, steps: int = 60) -> list[float]:
    moe = _moe(seed=3, router="sigmoid", load_balance=load_balance, aux_free_update_rate=0.01, n_shared_experts=0)
    with torch.no_grad():
        moe.router.weight.mul_(0.1)
    direction = moe.router.weight[0] / moe.router.weight[0].norm()
    torch.manual_seed(4)
    x = torch.randn(4, 32, 64) + 8.0 * direction  # every token prefers expert 0
    out = []
    moe.train()
    layers = [("1", moe)]
    for _ in range(steps):
        with torch.no_grad():
            moe(x)
        out.append(end_step(layers)["moe/imbalance"])
    return out


def test_aux_free_bias_update_moves_load_toward_balance():
    balanced = _skewed_imbalance("aux_free")
    assert balanced[0] >= 3.9  # expert 0 takes every token's first slot: 4x its fair share
    assert balanced[-1] < 0.5 * balanced[0]
    assert min(balanced[-10:]) < 1.6
    control = _skewed_imbalance("none")  # same input, no bias update: no change
    assert control[-1] == control[0]


def test_expert_bias_is_a_buffer():
    moe = _moe(load_balance="aux_free")
    assert "expert_bias" in dict(moe.named_buffers()) and "expert_bias" in moe.state_dict()
    assert all("expert_bias" not in n for n, _ in moe.named_parameters())


def test_trainer_logs_moe_metrics_without_double_counting_recompute(corpus_dir):
    from ndtrain.train.trainer import Trainer

    def one_step(ac):
        cfg = load_config(None, {"model": {"preset": "debug-moe", "capacity_factor": 1.0},
                                 "data": {"path": str(corpus_dir), "seq_len": 32},
                                 "parallel": {"activation_checkpoint": ac},
                                 "train": {"global_batch": 4, "micro_batch": 2, "seed": 5},
                                 "logging": {"tensorboard": False, "progress": "off"}})
        trainer = Trainer(cfg, run_dir=None, log=False)
        extra = trainer.train_step().extra
        row = trainer.metrics_row(trainer.train_step())
        trainer.close()
        return extra, row

    extra, row = one_step("none")
    layers = [key.split("/")[1] for key in extra if key.endswith("/tokens_per_expert")]
    assert layers == ["layer1", "layer2", "layer3"]  # layer 0 is dense in debug-moe
    for layer in layers:
        assert sum(extra[f"moe/{layer}/tokens_per_expert"]) == 4 * 32 * 2
        assert extra[f"moe/{layer}/imbalance"] >= 1.0
        assert 0.0 < extra[f"moe/{layer}/router_entropy"] <= math.log(8) + 1e-6
    assert 0.0 < extra["moe/dropped_frac"] < 0.5
    assert extra["moe/aux_loss"] > 0.0
    assert "moe/imbalance" in row and "moe/layer1/dropped_frac" in row
    recomputed, _ = one_step("full")
    assert recomputed["moe/layer2/tokens_per_expert"] == extra["moe/layer2/tokens_per_expert"]


def test_moe_parameter_counts():
    for name in ("debug-moe", "mixtral-8x7b", "deepseek-v3"):
        cfg = preset(name)
        from ndtrain.model.llama import build_model

        model = build_model(cfg, "meta")
        assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
        moe = model.layers[str(cfg.n_layers - 1)].feed_forward
        expert = sum(p.numel() for p in moe.experts.parameters()) // cfg.n_experts
        total_layer = sum(p.numel() for p in moe.parameters())
        assert num_params(cfg) - num_params(cfg, active_only=True) == \
            (cfg.n_layers - cfg.moe_dense_layers) * (cfg.n_experts - cfg.n_active_experts) * expert
        assert total_layer == cfg.n_experts * expert + cfg.n_experts * cfg.dim + \
            cfg.n_shared_experts * expert
    # Published Mixtral 8x7B: 46.7B total, 12.9B active.
    assert round(num_params(preset("mixtral-8x7b")) / 1e9, 1) == 46.7
    assert round(num_params(preset("mixtral-8x7b"), active_only=True) / 1e9, 1) == 12.9


@pytest.mark.parametrize("model,key", [
    ({"n_active_experts": 9}, "model.n_active_experts"),
    ({"expert_ffn_dim": 0}, "model.expert_ffn_dim"),
    ({"router": "relu"}, "model.router"),
    ({"load_balance": "both"}, "model.load_balance"),
    ({"capacity_factor": -1.0}, "model.capacity_factor"),
])
def test_moe_config_errors_name_their_key(model, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"model": {"preset": "debug-moe", **model}})
    assert err.value.key == key


@pytest.mark.parametrize("model,par,world,key", [
    ("debug", {"dp_shard": 2, "ep": 2}, 2, "parallel.ep"),
    ("debug-moe", {"dp_shard": 3, "ep": 3}, 3, "parallel.ep"),  # 8 experts over 3 ranks
    ("debug-moe", {"dp_shard": 2, "ep": 4}, 2, "parallel.ep"),  # ep larger than dp_shard x cp
    ("debug-moe", {"dp_shard": 2, "tp": 2, "ep": 4}, 4, "parallel.ep"),  # tp ranks are not ep ranks
    ("debug", {"dp_shard": -1, "ep": -1}, 2, "parallel.ep"),  # ep=-1 honoured (= dp_shard x cp), then refused
    ("debug-moe", {"dp_shard": -1, "ep": -1}, 3, "parallel.ep"),  # 3 ranks cannot split 8 experts
])
def test_expert_parallel_layout_errors_name_their_key(model, par, world, key):
    # Explicit degrees fail when the config loads (no world needed); -1 ones once the world is known.
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, {"model": {"preset": model}, "parallel": par})
        pdims.checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len)
    assert err.value.key == key


def test_ep_minus_one_takes_the_whole_shard_group():
    cfg = load_config(None, {"model": {"preset": "debug-moe"}, "parallel": {"dp_shard": -1, "ep": -1}})
    assert pdims.checked_layout(cfg.parallel, 4, cfg.model, cfg.data.seq_len).ep == 4
    assert pdims.checked_layout(cfg.parallel, 1, cfg.model, cfg.data.seq_len).ep == 1


def test_capacity_with_context_parallel_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"model": {"preset": "debug-moe", "capacity_factor": 1.0},
                           "parallel": {"dp_shard": 1, "cp": 2}, "data": {"seq_len": 64}})
    assert err.value.key == "model.capacity_factor"


def test_moe_init_is_by_name_and_the_bias_starts_at_zero():
    from ndtrain.model.init import init_std, materialize
    from ndtrain.model.llama import build_model

    assert init_std("layers.1.feed_forward.experts.w1", 4, 0.02) == 0.02
    assert init_std("layers.1.feed_forward.experts.w2", 4, 0.02) == pytest.approx(0.02 / math.sqrt(8))
    assert init_std("layers.1.feed_forward.shared_experts.w2.weight", 4, 0.02) == pytest.approx(0.02 / math.sqrt(8))
    assert init_std("layers.1.feed_forward.router.weight", 4, 0.02) == 0.02
    cfg = preset("debug-moe", load_balance="aux_free")
    a = materialize(build_model(cfg), seed=3)
    b = materialize(build_model(cfg), seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    moe = a.layers["2"].feed_forward
    assert torch.equal(moe.expert_bias, torch.zeros(8))
    # Experts are distinct draws (not one expert repeated).
    assert not torch.equal(moe.experts.w1[0], moe.experts.w1[1])


def test_experts_run_grouped_mm_in_the_autocast_dtype(monkeypatch):
    """Under autocast the experts' weights (fp32 masters outside FSDP) and tokens are cast to the
    autocast dtype for grouped_mm, which autocast itself leaves alone: CUDA's fused grouped GEMM
    takes bf16 only, and in fp32 the experts fell back to a matmul per expert with a host sync
    (`.tolist()`) per call. The CPU runs the same cast (its kernel is ~3x faster in bf16 here)."""
    real, calls = F.grouped_mm, []

    def recording(a, b, **kwargs):
        calls.append((a.dtype, b.dtype))
        return real(a, b, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", recording)
    moe = _moe(load_balance="none")
    x = torch.randn(2, 16, 64)
    ref = moe(x)
    assert calls and set(calls) == {(torch.float32, torch.float32)}  # no autocast: the weights' dtype
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert len(calls) == 3 and set(calls) == {(torch.bfloat16, torch.bfloat16)}
    # bf16 keeps 8 significant bits: each operand and result rounds by <= 2^-9 relative, and the
    # SwiGLU chains two matmuls with a product between, so ~6 roundings: 2% of the output's scale.
    torch.testing.assert_close(out.float(), ref, rtol=0.0, atol=0.02 * float(ref.detach().abs().max()))
    out.float().pow(2).sum().backward()
    assert moe.experts.w1.grad.dtype == torch.float32 and moe.experts.w1.grad.abs().sum() > 0
    # Which (device, dtype) pairs take the fused kernel in torch 2.13 (CUDA: bf16 only).
    from ndtrain.model.moe import fused_grouped_mm

    assert fused_grouped_mm("cuda", torch.bfloat16) and not fused_grouped_mm("cuda", torch.float32)
    assert fused_grouped_mm("cpu", torch.float32) and fused_grouped_mm("cpu", torch.bfloat16)
