"""`Linear`: nn.Linear whose fp32 matmuls on CPU can run through oneDNN instead of the BLAS.

torch sends a CPU fp32 matmul to the BLAS it was built with (MKL in the pip wheels) and keeps
oneDNN, bundled in the same wheel, for reduced precision. On the AMD EPYC this project is
measured on, MKL takes a slower path than oneDNN for the model's shapes: through oneDNN
(`torch.ops.mkldnn._linear_pointwise`, 1,024 tokens x dim 256-2,048) the forward ran 1.07-1.33x
and the input gradient 1.00-1.20x faster, the weight gradient (both operands transposed) 0.84-
1.06x, so that one stays on the BLAS; the whole model's forward + backward 1.07x
(benchmarks/cpu_matmul.py). Both are IEEE fp32; only the order of the sums differs
(docs/results/benchmarks.md, "oneDNN for the fp32 linears"). Another CPU may rank them the other way, so
`ndtrain train` takes the host probe's choice (calibrate/host_probe.py times this Linear with each
kernel; docs/host-probe.md) unless `[parallel] cpu_matmul` is given.

Everything else takes nn.Linear's own path: other dtypes and devices, autocast, tensor
subclasses (DTensor under tensor parallelism, float8), torch.compile (inductor picks its own
kernels), and `cpu_kernel = "blas"` (`[parallel] cpu_matmul`). It stays an nn.Linear, so
parameter names, checkpoints, HF export, TP plans and the fp8 swap see no difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.compat.torch import find, onednn_linear
from ndtrain.model.config import CPU_MATMUL_KERNELS


def _onednn_matmul(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [n, k] @ w[m, k]^T (+ bias) through oneDNN (looked up on first use, and only on CPU:
    a GPU run never touches the op; its FLOP formula comes with it, see compat.torch)."""
    return find("onednn_linear")(a, w, bias, "none", [], "")


def look_up_cpu_kernels() -> None:
    """As a model lands on CPU: look up oneDNN's op now, so a FlopCounterMode opened before the
    first forward already counts its matmuls."""
    onednn_linear()


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _onednn_matmul(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _onednn_matmul(g, weight.t()).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = g.t() @ x.reshape(-1, x.shape[-1])  # the BLAS: oneDNN was slower with these transposes
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Plain fp32 CPU tensors, outside autocast and compile, with oneDNN in this build."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter) and x.numel() > 0
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and torch.backends.mkldnn.is_available() and onednn_linear() is not None)


class Linear(nn.Linear):
    cpu_kernel = "onednn"  # or "blas"; set per model by set_cpu_kernel

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.weight.device.type == "cpu":
            look_up_cpu_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel == "onednn" and onednn_applies(x, self.weight):
            return _OneDnnLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def set_cpu_kernel(model: nn.Module, kernel: str) -> None:
    """Every Linear of `model` runs its CPU fp32 matmuls through `kernel` (CPU_MATMUL_KERNELS)."""
    if kernel not in CPU_MATMUL_KERNELS:
        raise ValueError(f"cpu kernel must be one of {', '.join(CPU_MATMUL_KERNELS)}, got {kernel!r}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.cpu_kernel = kernel
