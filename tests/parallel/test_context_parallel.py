"""Context parallel: layout, block kernels, attention vs full attention, training parity, config
errors, and the activation memory it divides.

Multi-process work is two launches: one world-4 launch (`cp_ranks` fixture) runs the attention
checks for cp=2 (two groups) and cp=4, the long-sequence training and the validation checks;
the parity test runs `verify` (one launch per world size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndtrain.config import load_config
from ndtrain.errors import ConfigError
from ndtrain.parallel import dims as pdims
from ndtrain.parallel.context import cp_positions, shard_sequence, unshard_sequence
from ndtrain.parallel.ring_attention import block_backward, block_forward, block_plan

ATTN_SEQ = 1024
LONG_SEQ = 4096
# World 1 at LONG_SEQ saves ~100 MB of activations (debug model); cp=4 must fit in a budget that
# one rank cannot.
LONG_BUDGET = 40 * 2**20
# fp32: attention blocks reassociated (test_cp_kernels.py's FP32_TOL derives 1e-5); the 3-step layout
# parity as in conftest's parity_base docstring.
TOL = 1e-5


# ---- single process --------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_layout_is_load_balanced_and_invertible(cp):
    seq = 8 * 2 * cp
    shards = [cp_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    # Causal work per rank (sum of positions + 1 = keys each query sees) is equal across ranks.
    work = {int((p + 1).sum()) for p in shards}
    assert len(work) == 1
    x = torch.arange(3 * seq).view(3, seq)
    parts = [shard_sequence(x, cp, r) for r in range(cp)]
    assert torch.equal(parts[0][:, :8], x[:, :8]) and torch.equal(parts[0][:, 8:], x[:, -8:])
    assert torch.equal(unshard_sequence(parts), x)


@pytest.mark.parametrize("cp", [2, 4])
def test_block_plan_tiles_the_causal_mask_exactly(cp):
    """The rectangles each rank computes, mapped to global positions, cover every (query, key)
    pair with key <= query exactly once and nothing else."""
    seq = 2 * cp * 4
    cover = torch.zeros(seq, seq, dtype=torch.int64)
    for r in range(cp):
        qpos = cp_positions(seq, cp, r)
        for src in range(cp):
            kpos = cp_positions(seq, cp, src)
            rows, keys, causal = block_plan(r, src, len(qpos))
            qp, kp = qpos[rows], kpos[keys]
            block = torch.ones(len(qp), len(kp), dtype=torch.int64)
            if causal:
                block = block.tril()
            cover[qp[:, None], kp[None, :]] += block
    assert torch.equal(cover, torch.ones(seq, seq, dtype=torch.int64).tril())


@pytest.mark.parametrize("causal,sq,sk", [(True, 48, 48), (False, 24, 48), (False, 48, 24)])
def test_portable_block_kernel_matches_fused(causal, sq, sk):
    g = torch.Generator().manual_seed(3)
    q, go = torch.randn(2, 3, sq, 16, generator=g), torch.randn(2, 3, sq, 16, generator=g)
    k, v = torch.randn(2, 3, sk, 16, generator=g), torch.randn(2, 3, sk, 16, generator=g)
    scale = 0.25
    out_f, lse_f = block_forward(q, k, v, causal, scale, fused=True)
    out_m, lse_m = block_forward(q, k, v, causal, scale, fused=False, rows=20)  # 20: chunks + a remainder
    torch.testing.assert_close(out_m, out_f, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse_m, lse_f, atol=TOL, rtol=TOL)
    grads_f = block_backward(go, q, k, v, out_f, lse_f, causal, scale, fused=True)
    grads_m = block_backward(go, q, k, v, out_f, lse_f, causal, scale, fused=False, rows=20)
    for a, b in zip(grads_m, grads_f):
        torch.testing.assert_close(a.float(), b.float(), atol=TOL, rtol=TOL)
    # And the fused block is plain causal/full attention.
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    torch.testing.assert_close(out_f, ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("parallel,seq_len,key", [
    ({"cp": 2, "dp_shard": 1}, 66, "data.seq_len"),  # 66 is not divisible by 2*cp = 4
    ({"cp": 4, "dp_shard": 1}, 68, "data.seq_len"),  # 68 = 8 * 8.5
    ({"cp": 2, "pp": 2, "dp_shard": 1}, 66, "data.seq_len"),  # cp inside a pipeline: the same rule
    ({"cp": 2, "cp_attention": "flash"}, 64, "parallel.cp_attention"),
])
def test_config_errors_name_their_key(parallel, seq_len, key):
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, {"parallel": parallel, "data": {"seq_len": seq_len}})
        world = 1
        for d in pdims.MESH_ORDER:
            world *= max(1, getattr(cfg.parallel, d))
        pdims.checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len)
    assert err.value.key == key and key in str(err.value)


# ---- one world-4 launch: attention, long sequence, validation --------------------------------
def _attention_inputs(seq):
    """q, k, v, grad_out with grouped-query heads (4 query heads share 2 K/V heads), as the model
    passes them."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, seq, 16, generator=g) for h in (4, 2, 2, 4)]


class _CountingComm:
    """Wraps a CPComm and tallies the bytes this rank puts on the wire, per message kind."""

    def __init__(self, comm):
        self._comm, self.sent = comm, {}

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _add(self, kind, t):
        self.sent[kind] = self.sent.get(kind, 0) + t.numel() * t.element_size()

    def shift(self, t, tag):
        from ndtrain.parallel.ring_attention import _TAG_KV

        self._add("kv" if tag == _TAG_KV else "dkv", t)
        return self._comm.shift(t, tag)

    def blocks(self, kv):
        if self._comm.mode == "allgather":
            self._add("kv", kv)  # this rank's contribution to the all-gather
        return type(self._comm).blocks(self, kv)  # `self`: so ring hops go through shift() above


def _layer_bytes(group, mode, expanded):
    """Bytes one cp rank sends for one debug-model attention layer, forward + backward, and the
    unexpanded K/V size. `expanded` feeds K/V pre-expanded to the query heads, i.e. what the kernel
    moved before it took grouped K/V."""
    from ndtrain.model.config import preset
    from ndtrain.model.llama import Attention, expand_kv
    from ndtrain.parallel.context import ContextParallelSDPA

    cfg, cp, cp_rank = preset("debug"), group.size(), group.rank()
    s_local = 64 // cp
    with torch.random.fork_rng():  # leave the rank's global RNG as the later checks expect it
        torch.manual_seed(0)
        attn = Attention(cfg)
        x = torch.randn(2, s_local, cfg.dim)
    sdpa = ContextParallelSDPA(group, mode)
    sdpa.comm = counter = _CountingComm(sdpa.comm)
    attn.sdpa = (lambda q, k, v: sdpa(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]))) if expanded else sdpa
    attn(x, cp_positions(64, cp, cp_rank)).sum().backward()
    kv_bytes = 2 * 2 * cfg.n_kv_heads * s_local * cfg.head_dim * 4  # k and v, fp32
    return counter.sent, kv_bytes


def _cfg(corpus, seq, parallel, gb=1):
    return load_config(None, {
        "model": {"preset": "debug", "max_seq_len": max(seq, 2048)},
        "data": {"path": str(corpus), "seq_len": seq},
        "optimizer": {"lr": 1e-3, "eps": 1e-6, "warmup_steps": 0, "schedule": "constant"},
        "train": {"global_batch": gb, "micro_batch": gb, "seed": 1234, "val_batches": 2},
        "parallel": {"dp_shard": 1, **parallel},
        "logging": {"tensorboard": False, "progress": "off"}})


def _long_run(cfg, steps=2, budget=None):
    from activation_meter import SavedActivationMeter
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir=None, log=False)
    losses, peaks = [], []
    for _ in range(steps):
        with SavedActivationMeter(budget) as meter:
            losses.append(trainer.train_step().loss)
        peaks.append(meter.peak_bytes)
    return {"losses": losses, "peak": max(peaks), "val": trainer.validation_loss(), "trainer": trainer}


def _rank_checks(corpus):
    import torch.distributed as dist

    from ndtrain.parallel.context import ContextParallelSDPA
    from ndtrain.parallel.ring_attention import CPComm, context_attention

    rank = dist.get_rank()
    q, k, v, go = _attention_inputs(ATTN_SEQ)
    out = {"attention": {}}
    for cp, groups in ((2, [[0, 1], [2, 3]]), (4, [[0, 1, 2, 3]])):
        made = [dist.new_group(g) for g in groups]  # every rank creates every group, in order
        group = next(pg for pg, g in zip(made, groups) if rank in g)
        cp_rank = dist.get_rank(group)
        for mode in ("ring", "allgather"):
            ql, kl, vl = (shard_sequence(t, cp, cp_rank, dim=2).requires_grad_() for t in (q, k, v))
            o = ContextParallelSDPA(group, mode)(ql, kl, vl)
            o.backward(shard_sequence(go, cp, cp_rank, dim=2))
            out["attention"][(cp, mode)] = (o.detach(), ql.grad, kl.grad, vl.grad)
        # The portable kernel (the fallback for what no fused kernel takes), through the whole ring.
        ql, kl, vl = (shard_sequence(t, cp, cp_rank, dim=2).requires_grad_() for t in (q, k, v))
        o = context_attention(ql, kl, vl, CPComm(group, "ring"), fused=False)
        o.backward(shard_sequence(go, cp, cp_rank, dim=2))
        out["attention"][(cp, "ring-portable")] = (o.detach(), ql.grad, kl.grad, vl.grad)
        for mode in ("ring", "allgather"):
            out.setdefault("bytes", {})[(cp, mode)] = [_layer_bytes(group, mode, e) for e in (False, True)]
    run = _long_run(_cfg(corpus, LONG_SEQ, {"cp": 4}), budget=LONG_BUDGET)
    try:
        run["trainer"].state.model(torch.zeros(1, LONG_SEQ // 4, dtype=torch.long))
        out["missing_positions"] = "no error"
    except RuntimeError as exc:
        out["missing_positions"] = str(exc)
    out["long"] = {k: v for k, v in run.items() if k != "trainer"}
    from ndtrain.train.trainer import Trainer

    cp2_dp2 = Trainer(_cfg(corpus, 64, {"cp": 2, "dp_shard": 2}, gb=8), run_dir=None, log=False)
    out["val_cp2_dp2"] = cp2_dp2.validation_loss()
    return out


@pytest.fixture(scope="module")
def cp_ranks(corpus_dir, hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    return run_ranks(4, _rank_checks, corpus_dir, timeout_s=hang_deadline(240))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "allgather", "ring-portable"])
def test_attention_matches_full_attention(cp_ranks, cp, mode):
    q, k, v, go = (t.requires_grad_() for t in _attention_inputs(ATTN_SEQ))
    rep = q.shape[1] // k.shape[1]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    ref.backward(go.detach())
    expected = (ref.detach(), q.grad, k.grad, v.grad)
    for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        # cp=2 ran in two independent groups (ranks 0-1 and 2-3): both must match.
        for first in range(0, 4, cp):
            got = unshard_sequence([cp_ranks[r]["attention"][(cp, mode)][i] for r in range(first, first + cp)], dim=2)
            torch.testing.assert_close(got, expected[i], atol=TOL, rtol=TOL, msg=f"{name} cp={cp} {mode}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_kv_traffic_is_unexpanded(cp_ranks, cp, mode):
    """Per layer a cp rank sends exactly the grouped (n_kv_heads) K/V: ring sends its K/V block
    cp-1 times in forward and again in backward, then cp hops of fp32 dK/dV; all-gather sends it
    once per pass. Feeding pre-expanded K/V (the old contract) costs n_heads/n_kv_heads more."""
    from ndtrain.model.config import preset

    cfg = preset("debug")
    for r in range(4):
        (sent, kv), (sent_expanded, _) = cp_ranks[r]["bytes"][(cp, mode)]
        if mode == "ring":
            assert sent == {"kv": 2 * (cp - 1) * kv, "dkv": cp * kv}, (r, sent, kv)
        else:
            assert sent == {"kv": 2 * kv}, (r, sent, kv)
        assert all(sent_expanded[k] == sent[k] * cfg.n_heads // cfg.n_kv_heads for k in sent), (sent_expanded, sent)


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_long_sequence_fits_budget_only_with_cp4(cp_ranks, corpus_dir):
    from activation_meter import ActivationBudgetExceeded

    cfg = _cfg(corpus_dir, LONG_SEQ, {})
    with pytest.raises(ActivationBudgetExceeded):
        _long_run(cfg, steps=1, budget=LONG_BUDGET)
    ref = _long_run(cfg)
    peaks = [r["long"]["peak"] for r in cp_ranks]
    ratio = ref["peak"] / max(peaks)
    assert ref["peak"] > LONG_BUDGET > max(peaks)
    assert 3.6 <= ratio <= 4.2, f"world-1 peak {ref['peak']} / cp=4 peak {max(peaks)} = {ratio:.2f}"
    for r in cp_ranks:  # trained within the budget, to the same losses and validation loss
        assert max(abs(a - b) for a, b in zip(r["long"]["losses"], ref["losses"])) <= TOL
        assert abs(r["long"]["val"] - ref["val"]) <= TOL


@pytest.mark.timeout(300)
def test_validation_and_positions_guard(cp_ranks, corpus_dir):
    from ndtrain.train.trainer import Trainer

    ref = Trainer(_cfg(corpus_dir, 64, {}, gb=8), run_dir=None, log=False).validation_loss()
    for r in cp_ranks:
        assert abs(r["val_cp2_dp2"] - ref) <= TOL
        assert "positions" in r["missing_positions"]


# ---- training parity ---------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_training_parity_vs_world1(parity_base):
    from ndtrain.tools.verify import verify

    layouts = ["cp=2", "cp=2,cp_attention=allgather,activation_checkpoint=full,ga=2",
               "cp=2,dp_shard=2", "cp=2,tp=2", "cp=4"]
    _, results = verify(parity_base, layouts, steps=3, tol_loss=TOL, tol_weight=TOL)
    bad = [r for r in results if not r.passed or r.d_grad_norm > TOL]
    assert len(results) == len(layouts) and not bad, "\n".join(
        f"{r.layout}: Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e} grad-norm rel {r.d_grad_norm:.1e}" for r in bad)
