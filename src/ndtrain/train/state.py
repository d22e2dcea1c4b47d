"""TrainState: everything one rank trains with, as build.py assembles it (mesh, data, model parts,
optimizer, DiLoCo, precision) and step.py advances it. Flat on purpose: the step, the job and
the checkpointer each read a field, never a field's field. Also the state's two views that
leave the step: the checkpointer of its stateful parts, and the full weights."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ndtrain.compat.torch import torch_logger
from ndtrain.config import JobConfig
from ndtrain.model.init import canonical_name
from ndtrain.train.checkpoint import DiLoCoState, ModelState, OptimizerState, RNGState, TrainProgress

if TYPE_CHECKING:  # names for the fields only: build.py imports the modules themselves
    from torch.distributed import ProcessGroup

    from ndtrain.data.loader import StatefulLoader, TokenDataset
    from ndtrain.data.mixture import MixtureDataset
    from ndtrain.layout import Layout
    from ndtrain.model.moe import MoE
    from ndtrain.parallel.diloco import DiLoCo
    from ndtrain.parallel.dims import Meshes
    from ndtrain.parallel.pipeline import Pipeline
    from ndtrain.train.distributed import Runtime
    from ndtrain.train.noise_scale import NoiseScale
    from ndtrain.train.step import StepResult


@dataclass
class TrainState:
    cfg: JobConfig  # the config that trains (the plan's)
    rt: Runtime  # rank, world, device
    layout: Layout  # the resolved layout (checked by its rules, batch rule included)
    mesh: Meshes  # one process: a mesh with no dimension
    train_set: TokenDataset | MixtureDataset  # the opened training split (manifest, eos id)
    loader: StatefulLoader  # this rank's data-parallel share (a MixtureLoader for a mixture)
    model_parts: list[nn.Module]  # the model, or this pipeline rank's stage(s)
    params: list[nn.Parameter]  # the trainable parameters of every part
    optimizer: torch.optim.Optimizer
    dp_rank: int
    dp_size: int
    cp_rank: int
    tp_rank: int
    cp_positions: torch.Tensor | None  # this cp rank's global RoPE positions (None: 0..s-1)
    pipeline: Pipeline | None = None  # the pipeline runtime when pp > 1
    fsdp: bool = False  # FSDP2 wraps the parts (plain replication has torch's DDP instead)
    moe: list[tuple[str, MoE]] = field(default_factory=list)  # (layer, MoE): routing statistics, aux-loss scale
    moe_group: ProcessGroup | None = None  # dp x cp group MoE statistics sum over (None: one such rank)
    diloco: DiLoCo | None = None  # when replicas sync every H steps
    scalar_group: ProcessGroup | None = None  # per-step scalars reduce here (DiLoCo: inside the replica)
    autocast: bool = False  # bf16 autocast around the forward (bf16/fp8 without FSDP's policy)
    fp8: bool = False
    fp8_scales: Callable[[list[nn.Module]], None] | None = None  # FSDP float8 all-gather: refresh the weights' fp8 scales
    progress: TrainProgress = field(default_factory=TrainProgress)  # step, tokens, skip windows
    # Set by checkpointer(): an async save may still be copying the state, and the optimizer must
    # not write the weights until it is done (the copy overlaps forward and backward).
    before_update: Callable[[], None] | None = None
    # The fixed validation batches, built on first use: (inputs, targets, document inputs or None)
    val_data: list[tuple[torch.Tensor, torch.Tensor, dict | None]] | None = None
    noise: NoiseScale | None = None  # under batch_ramp = "auto", built on first use
    # The first micro-batch's squared gradient norm this step, a device scalar
    first_micro_sq: torch.Tensor | None = None
    # Steps whose loss and norm are still on the device, oldest first (step.read_steps)
    unread: list[StepResult] = field(default_factory=list)

    @property
    def model(self) -> nn.Module:
        return self.model_parts[0]


def checkpointer(state: TrainState, run_dir: Path | None, cfg: JobConfig | None = None, *,
                 info: Callable[[str], None] = print, record: Callable[[dict], None] = lambda row: None):
    """A Checkpointer of the state's stateful parts (`cfg`: other checkpoint settings); `info`
    and `record`: the logger's line and row. Its staging wait guards the optimizer's update."""
    from ndtrain.train.checkpoint import Checkpointer, data_fingerprint

    model = ModelState(state.model_parts, fp8=state.fp8)
    states = {"model": model, "optim": OptimizerState(model, state.optimizer), "progress": state.progress,
              "loader": state.loader, "rng": RNGState()}
    if state.diloco:
        states["diloco"] = DiLoCoState(state.diloco)
    ckpt = Checkpointer(cfg or state.cfg, run_dir, states, runtime=state.rt,
                        data=data_fingerprint(state.train_set.manifest), layout=state.layout.describe(),
                        dp_size=state.dp_size, info=info, record=record)
    state.before_update = ckpt.wait_for_staging
    return ckpt


def full_weights(state: TrainState) -> dict[str, torch.Tensor]:
    """Unsharded fp32 copies of this rank's parameters (a collective under FSDP/TP)."""
    # Gathering FSDP x TP (strided) shards warns about sequential all-gathers; that is expected.
    torch_logger("redistribute_logger").setLevel(logging.ERROR)  # a private torch module's: compat.torch
    out = {}
    for part in state.model_parts:
        for name, t in part.state_dict().items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            out[canonical_name(name)] = t.detach().float().cpu().clone()
    return out
