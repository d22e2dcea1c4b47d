"""build(cfg, layout) -> TrainState: one rank's mesh, data, model parts, optimizer, DiLoCo and
precision policy, each made by a function of its own, in the order they depend on one another.
One code path for every layout: a single process is the layout whose degrees are all 1 (a mesh
with no dimension, no process group); a dimension adds work only where it exists (pipeline
stages, context-parallel positions, DiLoCo replicas, fp8 scales)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from ndtrain.config import JobConfig
from ndtrain.data.mixture import make_loader, open_dataset
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.model.init import materialize
from ndtrain.model.llama import build_model, set_cpu_bf16_attention
from ndtrain.model.moe import moe_layers
from ndtrain.parallel import dims as pdims
from ndtrain.parallel.compose import parallelize
from ndtrain.train import distributed
from ndtrain.layout.batch_shares import make_split
from ndtrain.train.balance import initial_weights
from ndtrain.train.optim import build_optimizer
from ndtrain.train.state import TrainState


def build(cfg: JobConfig, layout, *, host=None, train_set=None, mesh=None) -> TrainState:
    """This rank's TrainState for `cfg` in `layout` (resolved for this world: train/plan.py).
    `host`: the host probe's choices (plan_choices.host_choice), None when not probed.
    `train_set`: the training split to read instead of cfg.data's (the dry run's synthetic tokens);
    `mesh`: this layout's mesh, built already (the dry run builds it before its tensors turn fake)."""
    rt = distributed.setup(cfg.train)
    mesh = pdims.build_mesh(layout, rt.device.type) if mesh is None else mesh
    torch.manual_seed(cfg.train.seed)
    train_set = open_training_data(cfg) if train_set is None else train_set
    dp_rank, dp_size = mesh.coordinate("dp")
    loader = make_loader(train_set, cfg.data.seq_len, cfg.train.seed, dp_rank, dp_size)
    # The next batches are built on a thread while this step computes (pinned for a GPU copy).
    loader.start_prefetch(cfg.data.prefetch, pin_memory=rt.device.type == "cuda")
    loader.set_shares(initial_weights(cfg, layout, dp_size), layout.micro_batch, make_split)  # uneven shares, if any
    cp_rank = mesh.coordinate("cp")[0]
    positions = _rope_positions(cfg, layout, cp_rank, rt.device)
    parts, pipeline = model_parts(cfg, layout, mesh, rt.device, positions, host)
    fsdp = isinstance(parts[0], FSDPModule)
    params = [p for part in parts for p in part.parameters() if p.requires_grad]  # before DiLoCo adds its own
    moe = moe_layers(parts)
    # MoE routing statistics are summed over the ranks that saw different tokens (dp x cp).
    moe_group = mesh["dp_cp"].get_group() if moe else None  # None: one such rank
    optimizer = build_optimizer(parts, cfg.optimizer)
    diloco = build_diloco(cfg, layout, mesh, parts)
    autocast, fp8, fp8_scales = precision(cfg, layout, fsdp)
    return TrainState(
        cfg=cfg, rt=rt, layout=layout, mesh=mesh, train_set=train_set, loader=loader, model_parts=parts,
        params=params,
        optimizer=optimizer, dp_rank=dp_rank, dp_size=dp_size, cp_rank=cp_rank,
        tp_rank=mesh.coordinate("tp")[0], cp_positions=positions, pipeline=pipeline, fsdp=fsdp, moe=moe,
        moe_group=moe_group, diloco=diloco,
        scalar_group=diloco.replica_group if diloco else None, autocast=autocast, fp8=fp8, fp8_scales=fp8_scales)


def open_training_data(cfg: JobConfig):
    train_set = open_dataset(cfg.data.path, cfg.data.mix, "train")
    if train_set.vocab_size > cfg.model.vocab_size:
        raise NdtrainError(f"the data's tokenizer has {train_set.vocab_size} tokens but "
                           f"model.vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")
    if cfg.data.document_mask and train_set.eos_id is None:
        raise ConfigError("data.document_mask", f"{cfg.data.path} marks no document ends (a format-1 corpus); "
                                                "prepare it again with this ndtrain")
    return train_set


def _rope_positions(cfg: JobConfig, layout, cp_rank: int, device) -> torch.Tensor | None:
    """Context parallel: this rank holds a load-balanced share of each sequence, and the model
    (every pipeline stage too) needs those tokens' global positions for RoPE (None = 0..s-1, the
    whole sequence)."""
    if layout.cp == 1:
        return None
    from ndtrain.parallel.context import cp_positions

    return cp_positions(cfg.data.seq_len, layout.cp, cp_rank, device)


def model_parts(cfg: JobConfig, layout, mesh, device, positions, host) -> tuple[list, object | None]:
    """(the model parts this rank holds, the pipeline runtime or None). A pipeline rank builds
    only its own stage(s), several with virtual stages; every other layout holds one part, the
    whole model, built on the meta device, parallelised, then materialised."""
    pipeline = None
    if layout.pp > 1:
        from ndtrain.parallel.pipeline import build_pipeline

        pipeline = build_pipeline(cfg, layout, mesh, device, positions)
        parts = pipeline.parts
    else:
        model = parallelize(build_model(cfg.model, "meta"), layout, mesh)
        materialize(model, cfg.train.seed, device)
        parts = [model]
    if host is not None:  # the host probe's bf16 CPU attention kernel (plan_choices.host_choice)
        for part in parts:
            set_cpu_bf16_attention(part, host.bf16_attention)
    return parts, pipeline


def build_diloco(cfg: JobConfig, layout, mesh, parts):
    """DiLoCo (parallel/diloco.py): replicas train apart and sync every H steps; per-step
    scalars then reduce inside the replica only. None for every other layout."""
    if layout.replicate_sync != "diloco" or mesh is None:
        return None
    from ndtrain.parallel.diloco import DiLoCo

    return DiLoCo(cfg.parallel, mesh, layout, parts, cfg.train.steps, cfg.model.n_layers)


def precision(cfg: JobConfig, layout, fsdp: bool):
    """(autocast, fp8, fp8_scales). bf16 (and fp8, which is bf16 outside its fp8 matmuls)
    without FSDP (one process, or TP alone) runs under autocast instead of FSDP's policy; FSDP's
    float8 all-gather refreshes the weights' fp8 scales before each forward."""
    fp8 = layout.mixed_precision == "fp8"
    low = layout.mixed_precision in ("bf16", "fp8")
    fp8_scales = None
    if fp8 and fsdp:
        from ndtrain.parallel.float8 import float8_all_gather, precompute_scales

        fp8_scales = precompute_scales if float8_all_gather(layout) else None
    return (low and not fsdp) or cfg.train.autocast_bf16, fp8, fp8_scales
