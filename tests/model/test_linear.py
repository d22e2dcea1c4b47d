"""model/linear.py: fp32 CPU linears through oneDNN, equal to nn.Linear, and the cases that keep
nn.Linear's own path."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ndtrain.layout import Layout
from ndtrain.model.config import ModelConfig
from ndtrain.model.linear import Linear, set_cpu_kernel
from ndtrain.model.llama import build_model
from ndtrain.parallel.compose import parallelize


def _pair(bias: bool, d_in: int = 256, d_out: int = 768):
    torch.manual_seed(0)
    ours, ref = Linear(d_in, d_out, bias=bias), nn.Linear(d_in, d_out, bias=bias)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_forward_and_gradients_equal_nn_linear(bias):
    ours, ref = _pair(bias)
    x = torch.randn(4, 64, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), ref(x_ref)
    assert type(y.grad_fn).__name__ == "_OneDnnLinearBackward"  # the oneDNN path did run
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    # fp32, two GEMM kernels (oneDNN vs BLAS) summing 256 terms (in features; the weight grad's 4 x 64 tokens)
    # in another order: <= depth x 2^-24 ~ 1.5e-5 relative worst case, ~sqrt(depth) x 2^-24 ~ 1e-6 typical.
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_frozen_weight_and_no_grad():
    ours, ref = _pair(False, 32, 16)
    ours.weight.requires_grad_(False)
    x = torch.randn(3, 32, requires_grad=True)
    ours(x).sum().backward()
    assert ours.weight.grad is None and x.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_other_cases_take_nn_linears_path():
    ours, _ = _pair(False, 32, 16)
    x = torch.randn(3, 32, requires_grad=True)
    bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    assert type(bf16(x.to(torch.bfloat16)).grad_fn).__name__ != "_OneDnnLinearBackward"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast must still cast to bf16
        assert ours(x).dtype == torch.bfloat16
    ours.cpu_kernel = "blas"
    assert type(ours(x).grad_fn).__name__ != "_OneDnnLinearBackward"


def test_flop_counter_counts_onednn_matmuls_like_the_blas():
    model = build_model(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97), "cpu")
    x = torch.randint(0, 97, (2, 16))
    counts = {}
    for kernel in ("onednn", "blas"):
        set_cpu_kernel(model, kernel)
        with FlopCounterMode(display=False) as fc:
            model(x).sum().backward()
        counts[kernel] = fc.get_total_flops()
    assert counts["onednn"] == counts["blas"] > 0


def test_the_layout_key_reaches_every_linear():
    model = build_model(ModelConfig(), "meta")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 7 * ModelConfig().n_layers + 1  # q, k, v, o, w1-w3 per block, the head
    assert all(m.cpu_kernel == "onednn" for m in linears)  # the default
    parallelize(model, Layout(cpu_matmul="blas"))
    assert all(m.cpu_kernel == "blas" for m in linears)
    with pytest.raises(ValueError, match="onednn, blas"):
        set_cpu_kernel(model, "mkl")


def test_keep_freed_memory_keeps_large_blocks_in_the_heap(hang_deadline):
    """A fresh process each (mallopt is process-wide). By default glibc maps an 8 MiB tensor on
    its own pages (above the program break) and unmaps them when it is freed, so the next step
    page-faults them back; once set, the tensor lives in the heap (below the break) and freeing
    it leaves the heap as large as it was."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    code = (
        "import ctypes, sys, torch\n"
        "from ndtrain.train.distributed import keep_freed_memory\n"
        "libc = ctypes.CDLL('libc.so.6'); libc.sbrk.restype = ctypes.c_void_p\n"
        "if sys.argv[1] == '1': assert keep_freed_memory()\n"
        "x = torch.ones(2 << 20)\n"  # 8 MiB
        "end = x.data_ptr() + x.nbytes\n"
        "in_heap = end <= libc.sbrk(0)\n"
        "del x\n"
        "print(in_heap, end <= libc.sbrk(0))\n")
    out = {flag: subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, check=True,
                                timeout=hang_deadline(60)).stdout.split() for flag in ("0", "1")}
    assert out["0"] == ["False", "False"], out
    assert out["1"] == ["True", "True"], out
