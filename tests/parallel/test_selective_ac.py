"""Selective activation checkpointing (parallel/activation.py) keeps the outputs of the expensive
ops, so the backward's recompute re-runs only cheap elementwise work.

Each test counts the dispatches of an op during backward twice, with `selective` and with no
checkpointing, on the same weights and inputs. The difference is what the recompute re-ran: zero
for an op the policy saves. Each test also checks that a cheap op *was* recomputed, so a recompute
that never ran cannot pass for one that saved everything."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ndtrain.parallel.activation import apply_activation_checkpointing


class _CountOps(TorchDispatchMode):
    """Counts every aten op dispatched while active. Under selective checkpointing a saved op is
    answered from the checkpoint's cache above this mode, so it is not counted."""

    def __init__(self):
        super().__init__()
        self.n = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func] += 1
        return func(*args, **(kwargs or {}))


def backward_counts(make_model, inputs, mode: str) -> Counter:
    model = make_model()
    apply_activation_checkpointing(model, mode)
    out = model(*inputs)
    with _CountOps() as counter:
        out.float().square().sum().backward()
    return counter.n


def recomputed(make_model, inputs) -> Counter:
    """Per op: dispatches in backward under selective AC minus those without AC."""
    sel, none = backward_counts(make_model, inputs, "selective"), backward_counts(make_model, inputs, "none")
    return Counter({op: sel[op] - none[op] for op in set(sel) | set(none)})


class _Fp8Block(nn.Module):
    """What a dynamic tensorwise fp8 linear does (torchao's Float8Linear): amax, scale, cast,
    `_scaled_mm`; beside a differentiable branch, so backward needs the recompute. Tiny shapes:
    torch's CPU `_scaled_mm` is a reference kernel."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.register_buffer("w8", torch.randn(16, 16, generator=g).to(torch.float8_e4m3fn))

    def forward(self, x):
        xs = x.detach()  # _scaled_mm has no autograd formula; the fp8 branch is a constant
        scale = (xs.abs().max() / 448.0).float()  # aten.max: torchao's tensorwise amax
        rows = torch.amax(xs.abs(), dim=-1, keepdim=True)  # aten.amax: the rowwise recipe's
        x8 = (xs / scale).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        y = torch._scaled_mm(x8, self.w8.t(), scale_a=scale, scale_b=one, out_dtype=torch.bfloat16)
        return self.lin(x).sin() * y.float() * rows


class _Layers(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


@pytest.mark.timeout(60)
def test_selective_ac_does_not_recompute_fp8_matmuls_or_amax():
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    diff = recomputed(lambda: _Layers(_Fp8Block(), _Fp8Block()), (x,))
    aten = torch.ops.aten
    assert diff[aten._scaled_mm.default] == 0, diff
    assert diff[aten.max.default] == 0 and diff[aten.amax.default] == 0, diff
    assert diff[aten.addmm.default] == 0, diff  # the bf16/fp32 matmuls stay saved, as before
    assert diff[aten.sin.default] == 2, diff  # the recompute ran: one cheap op per block


class _ExpertsBlock(nn.Module):
    """The experts' grouped GEMM (model/moe.py's fused path: bf16) beside a cheap op."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(2, 16, 16, generator=g).to(torch.bfloat16))

    def forward(self, x):
        offs = torch.tensor([4, 8], dtype=torch.int32)
        y = torch.nn.functional.grouped_mm(x, self.w, offs=offs)
        return torch.sin(y) * y  # the product's backward needs sin(y): recomputed, or kept


@pytest.mark.timeout(60)
def test_selective_ac_keeps_the_experts_grouped_gemm():
    """Recomputing it reran every expert's forward in the backward (mixtral in the dry run: +27%
    FLOPs over the planner's selective count)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).requires_grad_()
    diff = recomputed(lambda: _Layers(_ExpertsBlock(), _ExpertsBlock()), (x,))
    assert diff[torch.ops.aten._grouped_mm.default] == 0, diff
    assert diff[torch.ops.aten.sin.default] == 2, diff  # the recompute ran: one cheap op per block


@pytest.mark.timeout(60)
def test_selective_ac_keeps_every_matmul_of_the_model():
    """The debug Llama, fp32 on CPU: its linears run through oneDNN (`mkldnn._linear_pointwise`,
    model/linear.py), which are matmuls like any other: none is recomputed."""
    from ndtrain.model.init import materialize
    from ndtrain.model.llama import build_model
    from ndtrain.model.config import preset

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    diff = recomputed(lambda: materialize(build_model(preset("debug")), seed=0), (tokens,))
    matmuls = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
               torch.ops.mkldnn._linear_pointwise.default]
    assert {op: diff[op] for op in matmuls} == {op: 0 for op in matmuls}, diff
    attention = [op for op in diff if "scaled_dot_product" in str(op)]
    assert attention and all(diff[op] == 0 for op in attention), diff
    assert diff[torch.ops.aten.rsqrt.default] > 0, diff  # RMSNorm was recomputed


@pytest.mark.timeout(120)
def test_selective_ac_with_torchao_fp8_recomputes_no_amax():
    """The debug model through the composer with `mixed_precision = "fp8"` (torchao's
    Float8Linear, bf16 autocast as one process trains): its amaxes are not recomputed (before:
    56 per backward, two per converted linear) and the gradients are those of no checkpointing.
    On CPU torchao runs the fp8 GEMM as an `mm` (on CUDA `_scaled_mm`), also not recomputed."""
    pytest.importorskip("torchao")
    from ndtrain.config import load_config
    from ndtrain.model.init import canonical_name, materialize
    from ndtrain.model.llama import build_model
    from ndtrain.parallel import dims as pdims
    from ndtrain.parallel.compose import parallelize

    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(5))
    runs = {}
    for ac in ("selective", "none"):
        cfg = load_config(None, {"model": {"preset": "debug"}, "data": {"seq_len": 64},
                                 "parallel": {"dp_shard": 1, "mixed_precision": "fp8", "activation_checkpoint": ac}})
        dims = pdims.checked_layout(cfg.parallel, 1, cfg.model, 64, data=cfg.data)
        model = materialize(parallelize(build_model(cfg.model, "meta"), dims, None), 0, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens).float().square().mean()
        with _CountOps() as counter:
            loss.backward()
        runs[ac] = counter.n, {canonical_name(n): p.grad for n, p in model.named_parameters()}
    (sel, sel_grads), (none, none_grads) = runs["selective"], runs["none"]
    aten = torch.ops.aten
    assert none[aten.max.default] > 0  # fp8 really ran: its backward takes amaxes of its own
    for op in (aten.max.default, aten.amax.default, aten.mm.default, aten._scaled_mm.default):
        assert sel[op] == none[op], (op, sel[op], none[op])
    assert sel[aten.abs.default] > none[aten.abs.default]  # the recompute ran (the casts' |x|)
    for name, g in none_grads.items():  # the same kernels on the same inputs: the same numbers
        torch.testing.assert_close(sel_grads[name], g, atol=0, rtol=0, msg=name)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # eager flex: CUDA compiles it
def test_selective_ac_saves_flex_attention(monkeypatch):
    """Flex attention (document masking on CUDA) run eagerly on CPU is not re-run in the
    recompute. torch refuses flex backward on CPU at the API level only; its eager (reference)
    backward runs here once that check is lifted. Counted in Python, not with `_CountOps`: eager
    flex under a user dispatch mode compiles its backward, which torch.compile refuses."""
    import torch.nn.attention.flex_attention as fa

    # The module, not the operator `torch._higher_order_ops.flex_attention` that shadows its name.
    hop = sys.modules["torch._higher_order_ops.flex_attention"]
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    calls = Counter()
    math_attention = hop.math_attention

    def counted(*args, **kwargs):  # the eager flex forward's kernel
        calls["flex"] += 1
        return math_attention(*args, **kwargs)

    monkeypatch.setattr(hop, "math_attention", counted)
    mask = fa.create_block_mask(lambda b, h, q, k: q >= k, 1, None, 32, 32, device="cpu")

    class FlexBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            calls["block"] += 1
            return fa.flex_attention(self.lin(x).cos(), x, x, block_mask=mask).sin()

    x = torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    runs = {}
    for mode in ("selective", "none"):
        model = _Layers(FlexBlock(), FlexBlock())
        apply_activation_checkpointing(model, mode)
        out = model(x)
        calls.clear()
        out.sum().backward()
        runs[mode] = dict(calls)
    assert runs["selective"].get("flex", 0) == runs["none"].get("flex", 0), runs
    assert runs["selective"]["block"] == 2 and "block" not in runs["none"], runs  # the recompute ran


# ---- TP + SP: the reduce-scatter after each row-parallel matmul -----------------------------
def _tp_rank(tokens):
    import torch.distributed as dist

    from ndtrain.config import load_config
    from ndtrain.model.init import canonical_name, materialize
    from ndtrain.model.llama import build_model
    from ndtrain.parallel import dims as pdims
    from ndtrain.parallel.compose import parallelize

    out = {}
    for ac in ("selective", "none"):
        cfg = load_config(None, {"model": {"preset": "debug"}, "data": {"seq_len": tokens.shape[1]},
                                 "parallel": {"dp_shard": 1, "tp": 2, "activation_checkpoint": ac}})
        dims = pdims.checked_layout(cfg.parallel, 2, cfg.model, tokens.shape[1], data=cfg.data)
        assert dims.sequence_parallel
        model = materialize(parallelize(build_model(cfg.model, "meta"), dims, pdims.build_mesh(dims, "cpu")), 0, "cpu")
        loss = model(tokens).float().square().mean()
        with _CountOps() as counter:
            loss.backward()
        dist.barrier()
        out[ac] = {str(op): n for op, n in counter.n.items()}
        out[ac + "_grads"] = {canonical_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    return out


@pytest.mark.timeout(180)
def test_selective_ac_does_not_recompute_tp_reduce_scatter(hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    for rank in run_ranks(2, _tp_rank, tokens, timeout_s=hang_deadline(120)):
        sel, none = rank["selective"], rank["none"]
        rs = "_c10d_functional.reduce_scatter_tensor.default"
        assert sel.get(rs, 0) == none.get(rs, 0), (sel.get(rs), none.get(rs))
        assert sel["aten.rsqrt.default"] > none.get("aten.rsqrt.default", 0)  # the recompute ran
        # The cached reduce-scatter outputs are the forward's own: the same gradients (to fp32
        # rounding; the recompute runs the same kernels on the same inputs).
        assert rank["selective_grads"].keys() == rank["none_grads"].keys()
        for name, g in rank["none_grads"].items():
            torch.testing.assert_close(rank["selective_grads"][name], g, msg=name)
