"""The runtime's layout: the config's `[parallel]` section checked by `ndtrain.layout.problems()`
for this world size, and the one place the device mesh is built.

The check needs only the config and the world size, so a layout that cannot work fails with a
readable message naming its key before any process group exists.
"""

from __future__ import annotations

from ndtrain.compat.torch import flatten_mesh, unflatten_mesh
from ndtrain.layout import Layout, from_config
from ndtrain.layout import check as check_layout
from ndtrain.layout.degrees import MESH_ORDER  # noqa: F401  (re-exported: the mesh's dimension names)
from ndtrain.model.config import ModelConfig


def checked_layout(par, world_size: int, model: ModelConfig, seq_len: int = 0, train=None, data=None) -> Layout:
    """`[parallel]` settings (with -1 degrees) -> the checked Layout for `world_size` ranks.
    With `train` (the [train] section) the micro-batch and pipeline micro-batch rules are checked
    for every global batch the run will use (batch ramp included); with `data` the [data] keys
    that constrain a layout (document_mask)."""
    lay = from_config(par, train, data)
    from ndtrain.config import layout_batches

    batches = layout_batches(train) if train is not None else None
    lay = check_layout(lay, model, world_size, seq_len or None, batches)
    if train is not None and getattr(par, "batch_shares", None):  # uneven shares need the dp degree
        from ndtrain.layout.batch_shares import check_shares

        check_shares(list(par.batch_shares), lay.dp, batches, lay.micro_batch)
    return lay


VIEWS = {  # flattened dimensions, by the name callers use
    "dp": ("dp_replicate", "dp_shard"),  # loader sharding
    "dp_shard_cp": ("dp_shard", "cp"),  # FSDP sharding: cp ranks shard parameters too
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # ranks that see different tokens
}


class One:
    """A dimension of size one: this rank is its only member, and it needs no process group."""

    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def get_group(self):
        return None


ONE = One()


class Meshes:
    """The device mesh of the dimensions in use, under the names callers use: the five of
    MESH_ORDER, the flattened VIEWS, and 'ep' / 'ep_fsdp' with expert parallelism.

    Only dimensions larger than one get process groups (on Gloo each `new_group` costs a
    rendezvous, and a size-1 dimension of world W costs W of them); a size-1 name answers with
    ONE. A view is built on first use (flattening is collective: SPMD code asks for the same views
    in the same order on every rank), and is just its dimension when only one of its parts is
    larger than one. A single process is the mesh with no dimension at all."""

    def __init__(self, dims: Layout, device_type: str, rank: int = 0):
        self.dims = dims
        self.rank = rank
        sizes = dict(zip(MESH_ORDER, dims.shape))
        self.used = tuple(n for n in MESH_ORDER if sizes[n] > 1 or (n == "dp_shard" and self._replicate_only()))
        self.root = None
        if self.used:
            from torch.distributed.device_mesh import init_device_mesh

            self.root = init_device_mesh(device_type, tuple(sizes[n] for n in self.used), mesh_dim_names=self.used)
        self._views: dict = {}

    def _replicate_only(self) -> bool:
        # FSDP replicating without sharding still wants a 2-D (replicate, shard) mesh: keep the
        # size-1 shard dimension then.
        return self.dims.dp_replicate > 1 and self.dims.dp_shard * self.dims.cp == 1

    def __getitem__(self, name: str):
        if name in self.used:
            return self.root[name]
        if name in MESH_ORDER:
            return ONE
        if name not in self._views:
            self._views.update(self._build_view(name))
        return self._views[name]

    def _build_view(self, name: str) -> dict:
        if name in ("ep", "ep_fsdp"):
            # Expert parallel: the same dp x cp ranks seen as (dp_replicate, dp_shard_cp / ep, ep);
            # 'ep' splits experts, 'ep_fsdp' shards them (one root, so FSDP can combine the two).
            d = self.dims
            edp = unflatten_mesh(self["dp_cp"], 0, (d.dp_replicate, d.dp_shard * d.cp // d.ep, d.ep),
                                 ("ep_replicate", "ep_shard", "ep"))
            # Without replicas the experts' FSDP mesh is the shard dimension alone: a 2-D mesh
            # with a replicate dimension of 1 has FSDP2 all-reduce every gradient over one rank.
            fsdp = edp["ep_shard"] if d.dp_replicate == 1 else edp["ep_replicate", "ep_shard"]
            return {"ep": edp["ep"], "ep_fsdp": fsdp}
        parts = tuple(n for n in VIEWS[name] if n in self.used)
        if not parts:
            return {name: ONE}
        if len(parts) == 1:
            return {name: self.root[parts[0]]}
        return {name: flatten_mesh(self.root[parts], name)}

    def coordinate(self, name: str) -> tuple[int, int]:
        """(this rank's index, size) along a dimension or view, from the rank alone: no group."""
        coords, r = {}, self.rank
        for n, extent in reversed(list(zip(MESH_ORDER, self.dims.shape))):  # row-major, like the mesh
            coords[n], r = r % extent, r // extent
        index, size = 0, 1
        for n in VIEWS.get(name, (name,)):
            extent = self.dims.shape[MESH_ORDER.index(n)]
            index, size = index * extent + coords[n], size * extent
        return index, size

    @property
    def ranks(self):
        """The global rank at every coordinate, [pp, dp_replicate, dp_shard, cp, tp] (row-major,
        as init_device_mesh numbers them)."""
        import torch

        return torch.arange(self.dims.world).reshape(self.dims.shape)

    def fsdp_mesh(self, dims: Layout, across_replicas: bool = True):
        """FSDP's mesh: 1-D (shard) without replication, 2-D (replicate, shard) for HSDP; cp ranks
        shard parameters too. Without `across_replicas` (DiLoCo) the 1-D shard mesh: gradients
        never leave the replica."""
        if not across_replicas and self._replicate_only():
            return self.root["dp_shard"]  # DiLoCo replicas of one rank each: FSDP over that rank
        if dims.dp_replicate == 1 or not across_replicas:
            return self["dp_shard_cp"]
        if self._replicate_only():
            return self.root["dp_replicate", "dp_shard"]
        shard = self["dp_shard_cp"]  # registers the flattened name with the root when it is one
        name = shard.mesh_dim_names[0]
        import warnings

        with warnings.catch_warnings():  # slicing a flattened dim out of the root is deprecated
            warnings.simplefilter("ignore", UserWarning)
            return self.root["dp_replicate", name]


def build_mesh(dims: Layout, device_type: str) -> Meshes:
    import torch.distributed as dist

    return Meshes(dims, device_type, dist.get_rank() if dist.is_initialized() else 0)
