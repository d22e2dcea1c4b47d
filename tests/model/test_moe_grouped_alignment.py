"""The experts' grouped GEMMs against what torch's CUDA kernel asks of group sizes, checked on CPU:
every grouped GEMM a step runs (forward, and the two autograd runs for each in backward) is
recorded with its operands' layouts and offsets, and torch's rule (moe.cuda_group_rule) must
accept the per-expert token counts as they come: unpadded, uneven and empty."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ndtrain.model import moe
from ndtrain.model.moe import GroupedExperts, cuda_group_rule, fused_operands


class GroupedCalls(TorchDispatchMode):
    """Every aten._grouped_mm run under it: (mat_a, mat_b, offsets)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            self.calls.append((args[0], args[1], offs.tolist()))
        return func(*args, **kwargs)


def test_a_steps_grouped_gemms_need_no_padding_of_uneven_or_empty_groups():
    torch.manual_seed(0)
    n_experts, dim, hidden = 4, 64, 96
    experts = GroupedExperts(n_experts, dim, hidden).to(torch.bfloat16)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    counts = torch.tensor([3, 0, 13, 1])  # none a multiple of 8 (16 bytes of bf16), one empty
    x = torch.randn(int(counts.sum()), dim, dtype=torch.bfloat16, requires_grad=True)
    with GroupedCalls() as rec:
        y = experts(x, counts)
        y.backward(torch.randn_like(y))
    assert len(rec.calls) == 9  # w1, w3, w2 forward; for each, the input's and the weight's gradient
    grouped_dims = set()
    for a, b, offs in rec.calls:
        assert offs == [3, 3, 16, 17]  # the offsets produced: the running sum of the counts, unpadded
        multiple, empty_ok = cuda_group_rule(a, b)
        assert multiple == 1 and empty_ok, (a.shape, a.stride(), b.shape, b.stride())
        grouped_dims.add((a.dim(), b.dim()))
    assert grouped_dims == {(2, 3), (2, 2)}  # rows grouped (forward, input grads), K grouped (weight grads)
    assert x.grad is not None and all(w.grad is not None for w in experts.parameters())


def test_the_rule_asks_for_a_multiple_where_a_group_starts_one_element_further():
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    w = torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    assert cuda_group_rule(x, w) == (1, True)
    assert cuda_group_rule(x.t().contiguous().t(), w) == (8, True)  # column-major tokens: 8 bf16 = 16 bytes
    assert cuda_group_rule(x.float().t().contiguous().t(), w.float()) == (4, True)
    g = torch.zeros(16, 32, dtype=torch.bfloat16)
    assert cuda_group_rule(x.t(), g) == (1, True)  # the weight gradient autograd forms
    assert cuda_group_rule(x.t().contiguous(), g) == (8, False)  # row-major along K: aligned, none empty
    assert cuda_group_rule(w.transpose(-1, -2), torch.zeros(64, 16, dtype=torch.bfloat16)) == (8, True)


def test_operands_the_cuda_kernel_would_refuse_take_the_per_expert_path():
    w = torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    assert fused_operands("cuda", torch.zeros(16, 64, dtype=torch.bfloat16), w)
    assert not fused_operands("cuda", torch.zeros(16, 12, dtype=torch.bfloat16), torch.zeros(4, 12, 32))  # 24-byte rows
    assert not fused_operands("cuda", torch.zeros(64, 16, dtype=torch.bfloat16).t(), w)  # column-major tokens
    assert not fused_operands("cuda", torch.zeros(17 * 64 + 1, dtype=torch.bfloat16)[1:].view(-1, 64)[:16], w)  # 2-byte offset
    assert fused_operands("cpu", torch.zeros(16, 12, dtype=torch.bfloat16), torch.zeros(4, 12, 32))
    with torch._subclasses.FakeTensorMode():  # shapes only, no data pointer: still decided
        assert fused_operands("cuda", torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(4, 64, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("fused", [True, False])
def test_both_paths_compute_the_same_groups(monkeypatch, fused):
    torch.manual_seed(1)
    x, w = torch.randn(17, 16), torch.randn(4, 16, 8)
    offs = torch.tensor([3, 3, 16, 17], dtype=torch.int32)
    called = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: called.append(1) or real(*a, **k))
    monkeypatch.setattr(moe, "fused_operands", lambda device_type, a, b: fused)
    out = moe.grouped_mm(x, w, offs)
    assert bool(called) == fused
    want = torch.cat([x[0:3] @ w[0], x[3:3] @ w[1], x[3:16] @ w[2], x[16:17] @ w[3]])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # fp32 on both paths
