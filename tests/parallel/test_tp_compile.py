"""torch.compile of tensor-parallel blocks (issue #28, item 12).

The cause of the old refusal: with tp > 1 the first block's input is the embedding's output,
which RowwiseParallel reduces with `async_op=True` and hands on through `to_local()` as an
AsyncCollectiveTensor (ACT). torch 2.13's AOTAutograd replaces an ACT input by its waited inner
tensor before tracing (torch/_functorch/_aot_autograd/frontend_utils.py, `process_inputs`), and
that inner tensor carries no autograd state, so the compiled block is traced as if its input did
not need a gradient. Its backward returns None for it; autograd zero-fills that with a plain
tensor for the embedding's Redistribute backward, which reads `grad_output._local_tensor`
(torch/distributed/tensor/_redistribute.py, NestedRedistribute.forward): AttributeError. Not a
CPU/Gloo limit: the same code runs on CUDA. parallel/tensor.py waits for the embedding's output
in an autograd-transparent step, so compiled blocks only ever see plain tensors.
"""

from __future__ import annotations

import pytest
import torch

from ndtrain.parallel.launch import run_ranks

# fp32 compiled-vs-eager: the graphs compute the same sums in another order (inductor fuses and
# reassociates). Each value here sums at most a few hundred fp32 terms (dim 64, ffn 128, 32
# tokens, vocab 64), so its worst-case relative error is ~256 x 2^-24 ~ 1.5e-5 per reduction and
# typically sqrt(256) x 2^-24 ~ 1e-6; measured 1e-7. 1e-5 (relative) admits reassociation, not
# a missing or zeroed gradient (relative error 1).
TOL = 1e-5


def _loss_and_grads(sp: bool, backend: str | None, moe: bool):
    """One forward + backward of a tiny TP model on this rank's tp=2 mesh; blocks compiled with
    `backend` as parallel/compose.py compiles them (None: eager)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from ndtrain.model.config import ModelConfig
    from ndtrain.model.init import materialize
    from ndtrain.model.llama import build_model
    from ndtrain.parallel.tensor import apply_tensor_parallel

    kw = dict(n_experts=4, n_active_experts=2, n_shared_experts=1, expert_ffn_dim=64, moe_dense_layers=1) if moe else {}
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64, **kw)
    model = build_model(cfg)  # on meta, sharded, then initialised as the trainer does
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sp)
    materialize(model, seed=0)
    if backend:
        for block in model.layers.values():
            block.compile(backend=backend)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
            loss.backward()
    except Exception as e:  # noqa: BLE001 - the failure is the result: report it, don't hang the other rank
        return {"error": f"{type(e).__name__}: {e}"}
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    grads = {n: full(p.grad).detach() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": full(loss).item(), "grads": grads, "params": [n for n, _ in model.named_parameters()]}


def _compare(cases, backend):
    out = []
    for sp, moe in cases:
        eager, compiled = _loss_and_grads(sp, None, moe), _loss_and_grads(sp, backend, moe)
        out.append({"case": f"sp={int(sp)} moe={int(moe)}", "eager": eager, "compiled": compiled})
    return out


def _check(results):
    for r in results:
        eager, compiled = r["eager"], r["compiled"]
        assert "error" not in eager, f"{r['case']} eager: {eager['error']}"
        assert "error" not in compiled, f"{r['case']} compiled: {compiled['error']}"
        assert abs(compiled["loss"] - eager["loss"]) <= TOL * abs(eager["loss"]), r["case"]
        assert compiled["grads"].keys() == eager["grads"].keys() == set(eager["params"]), r["case"]
        for name, g in eager["grads"].items():
            err = (compiled["grads"][name] - g).norm() / g.norm()
            assert err <= TOL, f"{r['case']} {name}: relative gradient error {err:.1e}"


@pytest.mark.timeout(240)
def test_tp_blocks_compile_and_match_eager_through_aot_autograd():
    """tp=2, sequence parallel on and off: compiled blocks give the eager loss and every
    parameter's gradient, the embedding's included. The `aot_eager` backend runs
    the AOTAutograd front end where the ACT input lost its gradient, without inductor's code
    generation (seconds instead of a minute per graph on 2 cores); the slow test uses inductor."""
    _check(run_ranks(2, _compare, [(True, False), (False, False)], "aot_eager")[0])


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="torch 2.13: AOTAutograd traces an AsyncCollectiveTensor input as its waited inner "
                          "tensor, which has no autograd state, so a compiled function returns no gradient "
                          "for it. XPASS means torch fixed it and parallel/tensor.py's wait is no longer needed")
def test_torch_compile_keeps_the_gradient_of_an_async_collective_input():
    """The torch defect alone, in one process: an ACT that requires grad (what DTensor's
    `to_local()` returns after an async redistribute) goes into a compiled function."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    class ToAsync(torch.autograd.Function):  # an ACT with autograd history, as to_local() makes
        @staticmethod
        def forward(ctx, x):
            return AsyncCollectiveTensor(x.detach().clone())

        @staticmethod
        def backward(ctx, grad):
            return grad

    w = torch.randn(4, 4, requires_grad=True)
    scale = torch.randn(4, 4, requires_grad=True)  # keeps the output differentiable either way
    out = torch.compile(lambda t, s: (t * s).sum(), backend="aot_eager")(ToAsync.apply(w), scale)
    (gw,) = torch.autograd.grad(out, [w], allow_unused=True)
    assert gw is not None, "the compiled function returned no gradient for its AsyncCollectiveTensor input"
    torch.testing.assert_close(gw, scale.detach())
