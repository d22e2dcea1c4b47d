"""FSDP2 on CPU ranks (parallel/data_parallel.py `overlap_on_gloo`): the gradient reduce-scatter
through torch's all-to-all gives Gloo's own result, and every FSDP module is wired to it and to
asynchronous, prefetched all-gathers. The numerics of whole layouts with it on are in the parity
matrix (test_parity.py, test_zero.py)."""

from __future__ import annotations

import pytest

from ndtrain.parallel.launch import run_ranks


def _compare_with_gloo():
    import torch
    import torch.distributed as dist

    from ndtrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    comm = AllToAllReduceScatter()
    out = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(world * 1001, generator=torch.Generator().manual_seed(rank)).to(dtype)
            ours = comm.allocate((1001,), dtype=dtype, device=torch.device("cpu"))
            comm(output_tensor=ours, input_tensor=x.clone(), group=group, op=op)
            theirs = torch.empty(1001, dtype=dtype)
            dist.reduce_scatter_single(theirs, x.clone(), op=op, group=group)
            out[f"{name}-{dtype}"] = (ours, theirs)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_reduce_scatter_matches_gloo(world, hang_deadline):
    ranks = run_ranks(world, _compare_with_gloo, timeout_s=hang_deadline(120))
    for r in ranks:
        assert len(r) == 4
        for key, (ours, theirs) in r.items():
            # Relative to the max: a sum over the world reassociated, <= world x 2^-24 in fp32; bf16 rounds
            # each partial sum by 2^-9, <= world x 2^-9 ~ 1e-2 at world 4.
            tol = 1e-6 if "float32" in key else 1e-2
            assert (ours.float() - theirs.float()).abs().max() <= tol * theirs.float().abs().max(), key
    # Each rank holds its own chunk: ranks differ.
    assert not ranks[0]["sum-torch.float32"][0].equal(ranks[1]["sum-torch.float32"][0])


def _wired_zero3_step():
    import torch
    import torch.nn.functional as F

    from ndtrain.layout import Layout
    from ndtrain.model.config import preset
    from ndtrain.model.init import materialize
    from ndtrain.model.llama import build_model
    from ndtrain.parallel import gloo_reduce_scatter
    from ndtrain.parallel.compose import parallelize
    from ndtrain.parallel.dims import build_mesh

    calls = []
    original = gloo_reduce_scatter.AllToAllReduceScatter.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    gloo_reduce_scatter.AllToAllReduceScatter.__call__ = counted
    dims = Layout(dp_shard=2)
    model = parallelize(build_model(preset("debug"), "meta"), dims, build_mesh(dims, "cpu"))
    materialize(model, 0, "cpu")
    blocks = list(model.layers.values())
    wiring = []
    for module in [model, *blocks]:
        state = module._get_fsdp_state()
        group = state._fsdp_param_groups[0]
        nxt = [s._fsdp_param_group for s in state._states_to_forward_prefetch]
        wiring.append((type(group._reduce_scatter_comm).__name__, group.unshard_async_op, len(nxt)))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return {"wiring": wiring, "calls": len(calls), "modules": 1 + len(blocks)}


@pytest.mark.timeout(120)
def test_zero3_on_cpu_uses_the_all_to_all_and_prefetches(hang_deadline):
    for r in run_ranks(2, _wired_zero3_step, timeout_s=hang_deadline(120)):
        # The root and each block: the all-to-all reduce-scatter, async unshards, and the next block
        # as forward prefetch (the root prefetches the first block; the last block none).
        assert [w[0] for w in r["wiring"]] == ["AllToAllReduceScatter"] * r["modules"]
        assert all(w[1] for w in r["wiring"])
        assert [w[2] for w in r["wiring"]] == [1] * (r["modules"] - 1) + [0]
        assert r["calls"] == r["modules"]  # one reduce-scatter per FSDP module in the backward
