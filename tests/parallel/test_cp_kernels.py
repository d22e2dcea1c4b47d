"""Context-parallel block kernels (parallel/block_attention.py): which fused kernel each device
and dtype gets, that the CUDA ops are called as their schemas and layouts demand (fake ops that
keep the CUDA conventions, and torch's own meta kernels), that their outputs are normalised to
one (out, lse) form, and that every block shape equals plain SDPA autograd, masked or not.

No GPU here: a CUDA tensor cannot be made, so the CUDA ops run as fakes on CPU tensors (with the
CUDA layouts: padded lse, state passed from forward to backward, the output layout the efficient
backward assumes) and as torch's meta kernels (the real schemas, shapes only). The same fused
tests run on a GPU where one is present (`DEVICES`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ndtrain.compat.torch import PRIVATE
from ndtrain.parallel import block_attention as blocks
from ndtrain.parallel.block_attention import CPU_FLASH, EFFICIENT, FLASH, PORTABLE, Kernel, pick_kernel

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (sq, sk, causal): a rank's own block, a block of an earlier rank (all queries, the first half
# of its keys), of a later rank (the second half of the queries, all its keys); see block_plan.
SHAPES = {"own": (48, 48, True), "earlier": (48, 24, False), "later": (24, 48, False)}
# fp32: fused and reference reduce the same products in another order. A length-n sum reordered
# moves by at most ~n*u*sum|terms| (u = 2**-24); n <= 48 keys or 16 head dims and |terms| of a few
# units (N(0,1) inputs, softmax weights <= 1) bound it near 1e-5.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16 (u = 2**-8): the fused kernel rounds its inputs' products' result, the probabilities it
# feeds the second matmul and the output once each, so ~3u relative of the largest value.
BF16_U = 2.0 ** -8


# ---- which kernel ----------------------------------------------------------------------------
@pytest.mark.parametrize("device,dtype,head_dim,masked,cap,expected", [
    ("cuda", torch.bfloat16, 128, False, (9, 0), FLASH),
    ("cuda", torch.float16, 64, False, (8, 0), FLASH),
    ("cuda", torch.bfloat16, 128, True, (9, 0), EFFICIENT),   # masks go in as the efficient kernel's bias
    ("cuda", torch.float32, 128, False, (9, 0), EFFICIENT),   # flash takes no fp32
    ("cuda", torch.bfloat16, 512, False, (9, 0), EFFICIENT),  # flash stops at head_dim 256
    ("cuda", torch.float16, 128, False, (7, 0), EFFICIENT),   # V100: no flash
    ("cuda", torch.bfloat16, 128, False, (7, 0), PORTABLE),   # no bf16 kernel before sm80
    ("cuda", torch.float32, 6, False, (9, 0), PORTABLE),      # not a multiple of the vector width
    ("cuda", torch.float64, 64, False, (9, 0), PORTABLE),
    ("cpu", torch.float32, 16, True, None, CPU_FLASH),
    ("cpu", torch.bfloat16, 6, False, None, CPU_FLASH),
    ("mps", torch.float32, 64, False, None, PORTABLE),
])
def test_pick_kernel(device, dtype, head_dim, masked, cap, expected):
    k = pick_kernel(device, dtype, head_dim, masked, cap)
    assert k.name == expected, k
    assert bool(k.reason) == (expected == PORTABLE)  # the portable path always says why


def test_a_model_forward_on_the_portable_path_logs_once(caplog):
    from ndtrain.parallel.context import ContextParallelSDPA

    class OneRank:  # the hook only asks the comm for the kernel choice path here
        size, rank, mode = 1, 0, "ring"

    sdpa = ContextParallelSDPA.__new__(ContextParallelSDPA)
    sdpa.comm, sdpa._docs, sdpa._told = OneRank(), None, set()
    q = torch.zeros(1, 2, 4, 8, dtype=torch.int32)  # an int dtype: no fused kernel takes it
    with caplog.at_level("WARNING", logger="ndtrain.parallel.context"):
        for _ in range(3):  # three layers
            with pytest.raises(Exception):  # the ring itself then fails on ints; only the log matters
                sdpa(q, q, q)
    assert len(caplog.records) == 1 and "portable" in caplog.records[0].getMessage(), caplog.records


# ---- fake CUDA ops: CPU math, CUDA conventions -----------------------------------------------
_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _Op:
    def __init__(self, fn):
        self.default = fn


class FakeCudaAten:
    """Stands in for block_attention's op lookup (`_op`): the four CUDA ops, computed by the CPU
    kernel, returning what the CUDA ops return and checking what the CUDA kernels assume."""

    def __init__(self):
        self.calls, self.seed, self.offset = [], torch.tensor(1234), torch.tensor(5678)
        self._scaled_dot_product_flash_attention = _Op(self._flash_fwd)
        self._scaled_dot_product_flash_attention_backward = _Op(self._flash_bwd)
        self._scaled_dot_product_efficient_attention = _Op(self._eff_fwd)
        self._scaled_dot_product_efficient_attention_backward = _Op(self._eff_bwd)

    def op(self, key: str):
        """block_attention's `_op`: the fake of the op compat.torch names `key`."""
        name = PRIVATE[key].attr.rsplit(".", 1)[1]
        assert name in vars(self), f"a CUDA kernel called {name}"  # e.g. the CPU op
        return vars(self)[name].default

    def _flash_fwd(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        self.calls.append("flash")
        assert dropout_p == 0 and not return_debug_mask
        out, lse = _cpu_fwd(q, k, v, 0.0, is_causal, scale=scale)
        sq, sk = q.shape[2], k.shape[2]
        return out, lse.contiguous().float(), None, None, sq, sk, self.seed, self.offset, q.new_empty(0)

    def _flash_bwd(self, go, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                   scale):
        self.calls.append("flash_backward")
        assert (cum_q, cum_k, max_q, max_k) == (None, None, q.shape[2], k.shape[2])
        assert seed is self.seed and offset is self.offset, "the forward's philox state must come back"
        assert lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        return _cpu_bwd(go, q, k, v, out, lse, 0.0, is_causal, scale=scale)

    def _eff_fwd(self, q, k, v, bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
        self.calls.append("efficient")
        assert compute_log_sumexp and dropout_p == 0
        b, h, sq, _ = q.shape
        if bias is not None:  # get_bias_4d_view and the kernel's alignment checks
            assert bias.shape == (b, h, sq, k.shape[2]) and bias.dtype == q.dtype
            assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0
        out, lse = _cpu_fwd(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
        width = math.ceil(sq / 32) * 32
        padded = torch.full((b, h, width), float("inf"))
        padded[..., :sq] = lse
        if bias is not None:  # what a row that sees nothing may come out as
            empty = torch.isinf(bias).all(-1)
            out, padded[..., :sq] = out.masked_fill(empty[..., None], float("nan")), lse.masked_fill(empty, float("nan"))
        return out, padded, self.seed, self.offset

    def _eff_bwd(self, go, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, *, scale):
        self.calls.append("efficient_backward")
        b, h, sq, d = q.shape
        assert seed is self.seed and offset is self.offset
        assert lse.is_contiguous() and lse.shape == (b, h, math.ceil(sq / 32) * 32) and torch.isinf(lse[..., sq:]).all()
        assert list(grad_input_mask) == [True, True, True, False]
        assert out.stride(2) == h * d and out.stride(1) == d, "the kernel reads out with row stride h*d"
        return (*_cpu_bwd(go, q, k, v, out, lse[..., :sq], 0.0, is_causal, attn_mask=bias, scale=scale), None)


# ---- references ------------------------------------------------------------------------------
def _inputs(shape, dtype, device, seed=3, heads=3, dim=16):
    sq, sk, causal = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    q, go = (torch.randn(2, heads, sq, dim, generator=g) for _ in range(2))
    k, v = (torch.randn(2, heads, sk, dim, generator=g) for _ in range(2))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, go)], causal


def _doc_mask(sq, sk, causal, device):
    """Queries from documents 0..3, keys from 1..2: rows of documents 0 and 3 see nothing."""
    g = torch.Generator().manual_seed(5)
    dq = torch.randint(0, 4, (2, sq), generator=g).sort(1).values
    dk = torch.randint(1, 3, (2, sk), generator=g).sort(1).values
    m = (dq[:, :, None] == dk[:, None, :])[:, None]
    if causal:
        m = m & torch.ones(sq, sk, dtype=torch.bool).tril()
    return m.to(device)


def _reference(q, k, v, go, causal, scale, mask):
    """fp32 SDPA autograd (the math backend) on the same (rounded) inputs: out, lse, dq, dk, dv. Rows that see no
    key get zero gradient (and the kernels give them out 0, lse -inf)."""
    q, k, v, go = (t.detach().float().requires_grad_() for t in (q, k, v, go))
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        mask = mask.tril() if causal else mask
    full_mask = mask.expand(q.shape[0], q.shape[1], *mask.shape[-2:])
    empty = ~full_mask.any(-1)
    with sdpa_kernel(SDPBackend.MATH):  # not the fused kernel under test (CPU's SDPA would pick it)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask | empty[..., None], scale=scale)
    out.backward(go.detach().masked_fill(empty[..., None], 0.0))
    s = (q.detach() @ k.detach().transpose(-1, -2) * scale).masked_fill(~full_mask, float("-inf"))
    return out.detach().masked_fill(empty[..., None], 0.0), torch.logsumexp(s, -1), q.grad, k.grad, v.grad, empty


def _check_block(kernel, shape, dtype, device, masked):
    (q, k, v, go), causal = _inputs(shape, dtype, device)
    scale = 0.3
    mask = _doc_mask(q.shape[2], k.shape[2], causal, device) if masked else None
    ref_out, ref_lse, *ref_grads, empty = _reference(q, k, v, go, causal, scale, mask)
    go = go.masked_fill(empty[..., None], 0.0)
    out, lse, aux = blocks.forward(kernel, q, k, v, causal, scale, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    if masked:
        assert empty.any() and torch.isneginf(lse[empty]).all() and out[empty].eq(0).all()
    # As the ring calls it (a finite global lse, the forward's own state), but with the layouts a
    # caller may hand over: out [b, h, s, d]-contiguous, lse a row-sliced view.
    lse_view = torch.cat([lse, lse], -1).masked_fill(empty.repeat(1, 1, 2), 0.0)[..., lse.shape[-1]:]
    grads = blocks.backward(kernel, go, q, k, v, out.contiguous(), lse_view, causal, scale, mask, aux)
    if dtype == torch.float32:
        tol = lambda ref: FP32_TOL  # noqa: E731
    else:
        tol = lambda ref: dict(atol=3 * BF16_U * float(ref.abs().max()), rtol=3 * BF16_U)  # noqa: E731
    torch.testing.assert_close(out.float(), ref_out, **tol(ref_out), msg=f"{kernel.name} {shape} out")
    seen = ~empty
    torch.testing.assert_close(lse[seen], ref_lse[seen], **tol(ref_lse[seen]), msg=f"{kernel.name} {shape} lse")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, **tol(ref), msg=f"{kernel.name} {shape} {name}")


# ---- the fused block kernels equal plain SDPA autograd -----------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "doc-mask"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_block_equals_sdpa_autograd(shape, masked, dtype, device):
    q = torch.empty(1, 1, 1, 16, dtype=dtype, device=device)
    kernel = blocks.kernel_for(q, masked)
    assert kernel.name != PORTABLE
    _check_block(kernel, shape, dtype, device, masked)


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "doc-mask"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_portable_block_equals_sdpa_autograd(shape, masked):
    _check_block(Kernel(PORTABLE, "asked"), shape, torch.float32, "cpu", masked)


# ---- the CUDA ops, faked on CPU: what is called and how its outputs come back ----------------
@pytest.mark.parametrize("kernel,masked", [(FLASH, False), (EFFICIENT, False), (EFFICIENT, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_ops_called_and_normalised(monkeypatch, shape, dtype, kernel, masked):
    fake = FakeCudaAten()
    monkeypatch.setattr(blocks, "_op", fake.op)
    _check_block(Kernel(kernel), shape, dtype, "cpu", masked)
    assert fake.calls == [kernel, f"{kernel}_backward"]


@pytest.mark.parametrize("kernel,masked", [(FLASH, False), (EFFICIENT, False), (EFFICIENT, True)])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_op_calls_bind_to_the_real_schemas(shape, kernel, masked):
    """torch's meta kernels for the CUDA ops: the arguments bind to the real schemas, and the
    outputs (the efficient lse padded to 32 rows here: 24 and 48 are not multiples of 32) come
    back normalised."""
    (q, k, v, go), causal = _inputs(shape, torch.bfloat16, "meta")
    mask = _doc_mask(q.shape[2], k.shape[2], causal, "meta") if masked else None
    out, lse, aux = blocks.forward(Kernel(kernel), q, k, v, causal, 0.3, mask)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    grads = blocks.backward(Kernel(kernel), go, q, k, v, out, lse, causal, 0.3, mask, aux)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert blocks.backward(Kernel(kernel), go, q, k, v, out, lse, causal, 0.3, mask)[0].shape == q.shape  # aux=None


# ---- the whole ring on the fake CUDA ops -------------------------------------------------------
def _ring_on_fake_cuda(seq):
    import torch.distributed as dist

    from ndtrain.parallel.context import shard_sequence
    from ndtrain.parallel.ring_attention import CPComm, context_attention

    q, k, v, go, doc = _ring_inputs(seq)
    rank, real, out = dist.get_rank(), blocks._op, {}
    fake = FakeCudaAten()
    blocks._op = fake.op  # a forked rank of its own: nothing else sees this
    try:
        for name, kernel, docs in (("flash", FLASH, None), ("efficient", EFFICIENT, None), ("masked", EFFICIENT, doc)):
            for mode in ("ring", "allgather"):
                ql, kl, vl = (shard_sequence(t, 2, rank, dim=2).requires_grad_() for t in (q, k, v))
                parts = None if docs is None else [shard_sequence(docs, 2, r) for r in range(2)]
                o = context_attention(ql, kl, vl, CPComm(dist.group.WORLD, mode), docs=parts, kernel=Kernel(kernel))
                o.backward(shard_sequence(go, 2, rank, dim=2))
                out[(name, mode)] = (o.detach(), ql.grad, kl.grad, vl.grad)
        out["calls"] = sorted(set(fake.calls))
    finally:
        blocks._op = real
    return out


def _ring_inputs(seq):
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(2, h, seq, 16, generator=g) for h in (4, 2, 2, 4))  # GQA: 4 q heads, 2 K/V
    doc = torch.randint(0, 3, (2, seq), generator=g).sort(1).values
    return q, k, v, go, doc


@pytest.mark.timeout(120)
def test_ring_on_fake_cuda_kernels_matches_full_attention(hang_deadline):
    """cp=2, ring and all-gather, flash / efficient / efficient with a document mask: the merge
    and the backward, fed what the CUDA kernels return, give full attention."""
    from ndtrain.parallel.context import unshard_sequence
    from ndtrain.parallel.launch import run_ranks

    seq = 80  # local 40, chunks of 20: lse padding is exercised (20, 40 are not multiples of 32)
    ranks = run_ranks(2, _ring_on_fake_cuda, seq, timeout_s=hang_deadline(90))
    q, k, v, go, doc = _ring_inputs(seq)
    for name in ("flash", "efficient", "masked"):
        mask = (doc[:, :, None] == doc[:, None, :])[:, None] if name == "masked" else None
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(2, 1), vr.repeat_interleave(2, 1),
                                             attn_mask=causal if mask is None else causal & mask)
        ref.backward(go)
        expected = (ref.detach(), qr.grad, kr.grad, vr.grad)
        for mode in ("ring", "allgather"):
            for i, what in enumerate(("out", "dq", "dk", "dv")):
                got = unshard_sequence([r[(name, mode)][i] for r in ranks], dim=2)
                torch.testing.assert_close(got, expected[i], **FP32_TOL, msg=f"{name} {mode} {what}")
    assert ranks[0]["calls"] == ["efficient", "efficient_backward", "flash", "flash_backward"]


# ---- benchmarks/context_parallel.py runs (its GPU form is the same code at real shapes) --------
@pytest.mark.timeout(180)
def test_benchmark_dry_run(corpus_dir, capsys):
    import importlib.util
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "context_parallel.py"
    spec = importlib.util.spec_from_file_location("cp_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--data", str(corpus_dir)]) == 0
    out = capsys.readouterr().out
    diffs = dict(re.findall(r"(sdpa|cp \([a-z-]+\)): fwd\+bwd .* ms .* MiB  max \|diff\| vs sdpa (\S+)", out))
    assert set(diffs) == {"sdpa", "cp (cpu-flash)", "cp (portable)"}, out
    assert all(float(d) <= 1e-5 for d in diffs.values()), diffs  # fp32: reassociation only (see FP32_TOL)
    assert re.search(r"seq +128 +cp 1 .* tok/s", out) and re.search(r"seq +128 +cp 2 .* tok/s", out), out
