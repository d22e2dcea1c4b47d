"""Process groups that ndtrain makes beside the device mesh's: each rank creates only its own.

`new_group` is a world-wide step: every rank takes part in the creation of every group, its
own or not, so groups that split the world into pieces of size k cost each rank world/k
creations (and, on NCCL bound to a device, world/k splits of the world communicator). With
local synchronization a rank creates just the group it belongs to, among its members only: one
creation per purpose, whatever the world. The hazard torch names, two ranks naming one group
differently, cannot arise: the name comes from the members and the count of groups each has
made, and every rank makes exactly one group per call, from a partition that covers the world,
so the counts stay equal everywhere.

On NCCL bound to a device (distributed.setup), torch makes each new group by splitting the world
communicator (ncclCommSplit), a step all of its ranks must take. Here they all do, at once, each
with its own group's colour: one split makes every group of the partition, the way DeviceMesh's
`split_group` makes a dimension's groups.
"""

from __future__ import annotations

import torch.distributed as dist


def own_group(rank_lists: list[list[int]], desc: str):
    """This rank's group among `rank_lists`, disjoint lists covering every rank, passed alike by
    every rank. A list of one rank is a group of one (kept, so the counts stay equal)."""
    world = dist.get_world_size()
    covered = sorted(r for ranks in rank_lists for r in ranks)
    if covered != list(range(world)):
        raise ValueError(f"{desc}: the rank lists must cover the {world} ranks once each, got {rank_lists}")
    me = dist.get_rank()
    mine = next(ranks for ranks in rank_lists if me in ranks)
    return dist.new_group(sorted(mine), use_local_synchronization=True, group_desc=desc)
