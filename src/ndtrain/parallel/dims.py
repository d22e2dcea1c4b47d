"""The runtime's layout: the config's `[parallel]` section checked by `ndtrain.layout.problems()`
for this world size, and the one place the device mesh is built.

The check needs only the config and the world size, so a layout that cannot work fails with a
readable message naming its key before any process group exists.
"""

from __future__ import annotations

from ndtrain.layout import Layout, from_config
from ndtrain.layout import check as check_layout
from ndtrain.layout.degrees import MESH_ORDER  # noqa: F401  (re-exported: the mesh's dimension names)
from ndtrain.model.config import ModelConfig

ParallelDims = Layout  # the resolved layout is what the runtime calls its dims


def resolve(par, world_size: int, model: ModelConfig, seq_len: int = 0, train=None, data=None) -> Layout:
    """`[parallel]` settings (with -1 degrees) -> the checked Layout for `world_size` ranks.
    With `train` (the [train] section) the micro-batch and pipeline micro-batch rules are checked
    for every global batch the run will use (batch ramp included); with `data` the [data] keys
    that constrain a layout (document_mask)."""
    lay = from_config(par, train, data)
    from ndtrain.config import layout_batches

    batches = layout_batches(train) if train is not None else None
    return check_layout(lay, model, world_size, seq_len or None, batches)


class Meshes:
    """The root mesh plus the flattened views other code uses, kept here because slicing a
    flattened dim back out of the root mesh is deprecated:
    'dp' (loader sharding), 'dp_shard_cp' (FSDP sharding), 'dp_cp' (loss/gradient averaging)."""

    def __init__(self, root, flat: dict):
        self.root = root
        self.flat = flat

    def __getitem__(self, key):
        if isinstance(key, str) and key in self.flat:
            return self.flat[key]
        return self.root[key]

    def fsdp_mesh(self, dims: Layout):
        """2-D (replicate, shard) mesh for FSDP/HSDP; cp ranks shard parameters too."""
        if dims.cp == 1:
            return self.root["dp_replicate", "dp_shard"]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self.root["dp_replicate", "dp_shard_cp"]


def build_mesh(dims: Layout, device_type: str) -> Meshes:
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_ORDER)
    flat = {
        "dp": root["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_shard_cp": root["dp_shard", "cp"]._flatten("dp_shard_cp"),
        "dp_cp": root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
    }
    if dims.ep > 1:
        # Expert parallel: the same dp x cp ranks seen as (dp_replicate, dp_shard_cp / ep, ep);
        # 'ep' splits experts, 'ep_fsdp' shards them (one root, so FSDP can combine the two).
        edp = flat["dp_cp"]._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp // dims.ep, dims.ep),
                                       ("ep_replicate", "ep_shard", "ep"))
        flat["ep"] = edp["ep"]
        flat["ep_fsdp"] = edp["ep_replicate", "ep_shard"]
    return Meshes(root, flat)
