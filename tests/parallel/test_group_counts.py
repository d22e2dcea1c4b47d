"""Process groups that ndtrain creates beside the device mesh grow with the mesh's dimensions,
not with the world: counted on torch's fake process group (no communication) at worlds 64 and
1,024, for DiLoCo's outer and replica groups and the tied embedding's pipeline-end pairs. Each
was one group per fibre (world / R, R and world / pp creations on every rank) before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COUNT = r"""
import json, sys
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore
from ndtrain.layout.degrees import Layout
from ndtrain.parallel.dims import build_mesh
from ndtrain.parallel.diloco import DiLoCo
from ndtrain.parallel.pipeline import TiedEmbedding

created = [0]
real = c10d._new_group_with_tag
def counting(*args, **kwargs):
    created[0] += 1
    return real(*args, **kwargs)
c10d._new_group_with_tag = counting

par = type("Par", (), dict(diloco_outer_lr=0.7, diloco_outer_momentum=0.9))()
out = []
for world in (64, 1024):
    for rank in (0, world // 2 + 3):  # a first-stage rank, and one of a middle stage
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        dims = Layout(pp=4, dp_replicate=4, dp_shard=world // 64, tp=4, replicate_sync="diloco")
        mesh = build_mesh(dims, "cpu")
        created[0] = 0
        diloco = DiLoCo(par, mesh, dims, [], 100, 4)
        diloco_groups = created[0]
        created[0] = 0
        tied = TiedEmbedding([], mesh, dims)
        row = {"world": world, "rank": rank, "diloco": diloco_groups, "tied": created[0],
               "outer": dist.get_process_group_ranks(diloco.outer_group),
               "replica": len(dist.get_process_group_ranks(diloco.replica_group)),
               "pair": dist.get_process_group_ranks(tied.group) if tied.group is not None else None}
        out.append(row)
        dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_groups_created_do_not_grow_with_the_world(hang_deadline):
    proc = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=hang_deadline(500))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in rows:
        world, rank = row["world"], row["rank"]
        assert (row["diloco"], row["tied"]) == (2, 1), row  # were world/4 + 4 and world/4
        # Still the right members: the replicas of this rank's coordinate, a whole replica, and
        # the first and last pipeline ranks of this rank's column (none for a middle stage).
        # (ranks are numbered over [pp, dp_replicate, dp_shard, tp], row-major)
        step = world // 16  # between replicas
        base = rank - (rank // step % 4) * step
        assert row["outer"] == [base + r * step for r in range(4)]
        assert row["replica"] == world // 4
        per_stage = world // 4
        assert row["pair"] == ([rank, rank + 3 * per_stage] if rank < per_stage else None)
