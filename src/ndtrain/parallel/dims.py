"""Parallel degrees: resolution, validation and the one place the device mesh is built.

Validation needs only the config and the world size, so a layout that cannot work fails with a
readable message before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.model.config import ModelConfig

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, tp innermost
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different samples (the loader's data-parallel size)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_ORDER)

    def describe(self) -> str:
        parts = [f"{d}={getattr(self, d)}" for d in (*MESH_ORDER, "ep") if getattr(self, d) > 1]
        return " x ".join(parts) if parts else "single"


def resolve(par, world_size: int, model: ModelConfig, seq_len: int = 0, train=None,
            document_mask: bool = False) -> ParallelDims:
    """Turn `[parallel]` settings (with at most one -1) into validated degrees for `world_size`.
    With `train` (the [train] section) pipeline micro-batch counts are checked too."""
    degrees = {d: getattr(par, d) for d in MESH_ORDER}
    free = [d for d, v in degrees.items() if v == -1]
    fixed = 1
    for d, v in degrees.items():
        if v != -1:
            fixed *= v
    if free:
        if world_size % fixed:
            raise NdtrainError(
                f"world size {world_size} is not divisible by the fixed degrees "
                f"({' x '.join(f'{d}={v}' for d, v in degrees.items() if v not in (-1, 1)) or '1'} = {fixed}); "
                f"change [parallel] or the number of processes")
        degrees[free[0]] = world_size // fixed
    elif fixed != world_size:
        raise NdtrainError(
            f"[parallel] degrees multiply to {fixed} "
            f"({' x '.join(f'{d}={v}' for d, v in degrees.items())}) but the world size is {world_size}; "
            f"set one degree to -1 or launch {fixed} processes")
    dims = ParallelDims(ep=par.ep, **degrees)
    validate(dims, par, model, seq_len, train, document_mask)
    return dims


def validate(dims: ParallelDims, par, model: ModelConfig, seq_len: int = 0, train=None,
             document_mask: bool = False) -> None:
    tp, pp, cp, ep = dims.tp, dims.pp, dims.cp, dims.ep
    # data.document_mask rule: pipeline stages receive hidden states only (positions come from the
    # stage), so per-row document ids and positions would not reach the later stages.
    if document_mask and pp > 1:
        raise ConfigError("data.document_mask", "document masking does not combine with pipeline parallel (pp > 1) yet; "
                                                "set document_mask=false or pp=1")
    if par.compile and tp > 1:
        # torch 2.13's compiled blocks lose DTensor's local tensor on the TP path (AttributeError
        # '_local_tensor' inside the graph); FSDP, CP and EP blocks compile and match eager.
        raise ConfigError("parallel.compile", "torch.compile of tensor-parallel blocks fails in torch 2.13; "
                                              "set compile=false or tp=1")
    if model.n_heads % tp:
        raise ConfigError("parallel.tp", f"model.n_heads={model.n_heads} is not divisible by tp={tp}")
    if model.n_kv_heads % tp:
        raise ConfigError("parallel.tp", f"model.n_kv_heads={model.n_kv_heads} is not divisible by tp={tp} "
                                         f"(kv-heads are sharded, not replicated)")
    if model.ffn_dim % tp:
        raise ConfigError("parallel.tp", f"model.ffn_dim={model.ffn_dim} is not divisible by tp={tp}")
    if model.vocab_size % tp:
        raise ConfigError("parallel.tp", f"model.vocab_size={model.vocab_size} is not divisible by tp={tp}")
    if model.is_moe and model.expert_ffn_dim % tp:
        raise ConfigError("parallel.tp", f"model.expert_ffn_dim={model.expert_ffn_dim} is not divisible by tp={tp}")
    if cp > 1 and pp > 1:
        # Pipeline stages are called with hidden states only; without the cp shard's global
        # positions RoPE would be silently wrong.
        raise ConfigError("parallel.cp", "context parallel does not combine with pipeline parallel (pp > 1) yet")
    if pp > 1:
        stages = pp * par.pp_virtual_stages
        if par.pp_schedule not in PP_SCHEDULES:
            raise ConfigError("parallel.pp_schedule", f"unknown schedule {par.pp_schedule!r} (choose from {', '.join(PP_SCHEDULES)})")
        if par.layers_per_stage:
            if len(par.layers_per_stage) != stages:
                raise ConfigError("parallel.layers_per_stage", f"has {len(par.layers_per_stage)} entries but there are {stages} stages (pp x pp_virtual_stages)")
            if sum(par.layers_per_stage) != model.n_layers or min(par.layers_per_stage) < 1:
                raise ConfigError("parallel.layers_per_stage", f"must be positive and sum to model.n_layers={model.n_layers}")
        elif model.n_layers < stages:
            raise ConfigError("parallel.pp", f"model.n_layers={model.n_layers} is fewer than the {stages} pipeline stages")
        if model.tie_embeddings:
            raise ConfigError("model.tie_embeddings", "tied embeddings span the first and last pipeline stage; untie them for pp > 1")
        from ndtrain.parallel.pipeline_schedule import pipeline_problem

        problem = pipeline_problem(dims, par, model, train)
        if problem:
            raise ConfigError(*problem)
    elif par.pp_virtual_stages != 1:
        raise ConfigError("parallel.pp_virtual_stages", "virtual stages need pp > 1")
    if cp > 1 and seq_len and seq_len % (2 * cp):
        raise ConfigError("data.seq_len", f"seq_len={seq_len} must be divisible by 2*cp={2 * cp} for load-balanced causal chunks")
    if ep > 1:
        if not model.is_moe:
            raise ConfigError("parallel.ep", "expert parallel needs a mixture-of-experts model (model.n_experts > 0)")
        if model.n_experts % ep:
            raise ConfigError("parallel.ep", f"model.n_experts={model.n_experts} is not divisible by ep={ep}")
        if (dims.dp_shard * cp) % ep:
            raise ConfigError("parallel.ep", f"ep={ep} must divide dp_shard*cp={dims.dp_shard * cp} (experts are sharded over data-parallel ranks)")
        if par.activation_checkpoint == "selective":
            # The experts' own FSDP hooks run inside the checkpointed block, and selective
            # recompute demands the exact op sequence of the forward, which they change.
            raise ConfigError("parallel.activation_checkpoint", "selective checkpointing does not combine with ep > 1; use full or every_n")
    if cp > 1 and model.is_moe and model.capacity_factor > 0:
        raise ConfigError("model.capacity_factor", "capacity is per sequence, and cp > 1 splits sequences over ranks; set it to 0 (no dropping) for context parallel")
    from ndtrain.layout.fp8 import problems as fp8_problems

    for problem in fp8_problems(par, model, dims, seq_len):
        raise ConfigError(*problem)
    if par.cpu_offload and dims.dp == 1 and dims.world_size == 1:
        raise ConfigError("parallel.cpu_offload", "CPU offload shards with FSDP; it needs at least 2 processes")


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

    def fsdp_mesh(self, dims: ParallelDims):
        """2-D (replicate, shard) mesh for FSDP/HSDP; cp ranks shard parameters too."""
        if dims.cp == 1:
            return self.root["dp_replicate", "dp_shard"]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return self.root["dp_replicate", "dp_shard_cp"]


def build_mesh(dims: ParallelDims, device_type: str) -> Meshes:
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
