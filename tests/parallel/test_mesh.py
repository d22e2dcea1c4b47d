"""The mesh builds process groups only for the dimensions in use, and answers every name callers
use (the five dimensions, the flattened views) with the same ranks and sizes as the full mesh
of all five dimensions and three views it replaced."""

from __future__ import annotations

import pytest

from ndtrain.layout import Layout
from ndtrain.parallel.launch import run_ranks

# world 4: (degrees, process groups each rank may create at most)
LAYOUTS = [
    ({"dp_shard": 2, "tp": 2}, 4),  # two dimensions of two: two groups each
    ({"dp_replicate": 2, "dp_shard": 2}, 4 + 2),  # + the flattened 'dp' view (loader), built on use
    ({"cp": 2, "dp_shard": 2}, 4 + 2),  # + 'dp_shard_cp' (FSDP shards over cp too)
    ({"dp_replicate": 4}, 4 + 4),  # DDP: FSDP's 2-D mesh keeps a size-1 shard dimension
    ({"pp": 2, "tp": 2}, 4),
]
NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp")


def _check(layouts):
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from ndtrain.layout.degrees import MESH_ORDER
    from ndtrain.parallel.dims import VIEWS, build_mesh

    calls = [0]
    new_group = c10d._new_group_with_tag

    def counting(*args, **kwargs):
        calls[0] += 1
        return new_group(*args, **kwargs)

    out = []
    for degrees, _ in layouts:
        dims = Layout(**{"dp_shard": 1, **degrees})
        c10d._new_group_with_tag = counting
        calls[0] = 0
        mesh = build_mesh(dims, "cpu")
        seen = {n: (mesh[n].get_local_rank(), mesh[n].size()) for n in NAMES}  # every name, groups included
        coords = {n: mesh.coordinate(n) for n in NAMES}
        fsdp = mesh.fsdp_mesh(dims).mesh.tolist() if dims.world // (dims.tp * dims.pp) > 1 else None
        groups = calls[0]
        c10d._new_group_with_tag = new_group
        # The mesh it replaced: all five dimensions and the three views, built eagerly.
        full = init_device_mesh("cpu", dims.shape, mesh_dim_names=MESH_ORDER)
        want = {n: (full[n].get_local_rank(), full[n].size()) for n in MESH_ORDER}
        for view, parts in VIEWS.items():
            flat = full[parts]._flatten(view)
            want[view] = (flat.get_local_rank(), flat.size())
        out.append({"groups": groups, "seen": seen, "coords": coords, "want": want, "fsdp": fsdp,
                    "ranks": mesh.ranks.tolist(), "full_ranks": full.mesh.tolist()})
    return out


@pytest.mark.timeout(240)
def test_groups_only_for_dimensions_in_use_and_the_same_coordinates(hang_deadline):
    results = run_ranks(4, _check, LAYOUTS, timeout_s=hang_deadline(120))
    for rank, per_layout in enumerate(results):
        for (degrees, most), r in zip(LAYOUTS, per_layout):
            assert r["groups"] <= most, (degrees, r["groups"])
            assert r["seen"] == r["want"] and r["coords"] == r["want"], (degrees, rank)
            assert r["ranks"] == r["full_ranks"]
    fsdp = {str(d): r["fsdp"] for (d, _), r in zip(LAYOUTS, results[0])}
    assert fsdp[str({"dp_shard": 2, "tp": 2})] == [0, 2]  # 1-D: shard only
    assert fsdp[str({"dp_replicate": 2, "dp_shard": 2})] == [[0, 1], [2, 3]]  # 2-D: (replicate, shard)
    assert fsdp[str({"dp_replicate": 4})] == [[0], [1], [2], [3]]


def test_one_process_is_the_mesh_with_no_dimension():
    from ndtrain.parallel.dims import ONE, build_mesh

    mesh = build_mesh(Layout(dp_shard=1), "cpu")
    assert mesh.root is None and all(mesh[n] is ONE for n in NAMES)
    assert all(mesh.coordinate(n) == (0, 1) for n in NAMES) and mesh["dp_cp"].get_group() is None
