"""FP8 training through torchao: the qualifying Linear layers (layout/fp8.py `converts`) become
torchao `Float8Linear`, whose matmuls cast input, weight and output gradient to float8 with
dynamic scales (tensorwise: one scale per tensor; rowwise: one per row, powers of two) and run
`torch._scaled_mm`. Everything else computes in bf16 like `mixed_precision = "bf16"`, and the
parameters stay fp32 masters: checkpoints hold exactly what a bf16 run holds.

Applied first by the composer, on the meta model, because tensor parallel and FSDP must wrap
the Float8Linear modules (and, for float8 all-gather, their weight tensor subclass).

FSDP float8 all-gather (tensorwise only, as torchao supports): a sharded weight is cast to fp8
before its all-gather, halving those bytes against bf16. Its scale is one max over the whole
weight; `precompute_scales` computes all of them with one all-reduce before each forward that
follows a change of the weights (the trainer calls it at the start of a step and of validation,
so a resume or rollback is covered too) instead of one all-reduce per weight inside the forward.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from ndtrain.compat.torch import dtensor_local, torch_logger
from ndtrain.errors import ConfigError
from ndtrain.launch_env import local_rank
from ndtrain.layout.fp8 import converts
from ndtrain.model.init import canonical_name
from ndtrain.model.linear import Linear


def torchao_float8():
    """Import torchao.float8 without its import-time noise on CPU: a CUDA-only kernel library that
    cannot load, and a torch deprecation notice about an Enum it registers."""
    quiet = [logging.getLogger("torchao"), torch_logger("pytree_logger")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return f8


def float8_all_gather(lay) -> bool:
    """FSDP all-gathers fp8 weights when the recipe is tensorwise and parameters rest sharded
    (every ZeRO stage over a shard group of more than one rank: ZeRO-1/2 gather them once per
    step, ZeRO-3 per block)."""
    return lay.fp8_recipe == "tensorwise" and lay.shard_degree > 1


def float8_config(lay):
    f8 = torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(lay.fp8_recipe)
    if float8_all_gather(lay):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


FP8_CAPABILITY = (8, 9)  # float8 tensor cores (and torch._scaled_mm on CUDA): Ada, Hopper and newer


def check_device(device: torch.device) -> None:
    """Refuse fp8 on a CUDA GPU without float8 matmuls (A100 is 8.0): torch._scaled_mm would fail
    inside the first step, deep in torchao, after the model was built. CPU runs keep torch's
    CPU kernel (slow, for tests)."""
    if device.type != "cuda":
        return
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability >= FP8_CAPABILITY:
        return
    name = torch.cuda.get_device_name(device)
    exc = ConfigError("parallel.mixed_precision",
                      f"'fp8' needs a GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer "
                      f"(float8 matmuls: L4/L40, H100/H200, B200); {name} ({device}) is {capability[0]}."
                      f"{capability[1]}: use 'bf16'")
    # Every rank of a node has the same GPUs, so each node's local rank 0 speaks for it (an error
    # marked all_ranks is printed by rank 0 only): one line per node, not one per GPU.
    exc.all_ranks = local_rank() != 0
    raise exc


def _current_device() -> torch.device:
    """The device this process trains on: distributed.setup made the rank's GPU current on a CUDA
    run (which initialises CUDA); a CPU run leaves CUDA untouched, even on a GPU machine."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_float8(model: nn.Module, lay) -> list[str]:
    """Swap the qualifying nn.Linear layers of `model` for Float8Linear, in place; returns their
    canonical names."""
    check_device(_current_device())
    f8 = torchao_float8()
    converted: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        name = canonical_name(fqn)
        ok = type(module) in (nn.Linear, Linear) and converts(name, module.in_features, module.out_features, lay.tp)
        if ok:
            converted.append(name)
        return ok

    f8.convert_to_float8_training(model, module_filter_fn=keep, config=float8_config(lay))
    return converted


def is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def precompute_scales(parts: list[nn.Module]) -> None:
    """After an optimizer step: the fp8 scales of every float8-all-gathered weight, one all-reduce."""
    f8 = torchao_float8()
    for part in parts:
        f8.precompute_float8_dynamic_scale_for_fsdp(part)


def plain_state(state):
    """The state dict with torchao's float8 all-gather weight wrapper (and optimizer moments that
    inherited it) replaced by the fp32 tensor it wraps, sharing its memory: checkpoints then hold
    plain tensors that any layout, precision or tool loads (torch.load(weights_only=True) cannot
    unpickle the wrapper without torchao), and loading into them writes the live weights."""
    if isinstance(state, dict):
        return {k: plain_state(v) for k, v in state.items()}
    local = dtensor_local(state)  # DTensor._local_tensor is private torch: compat.torch
    inner = getattr(local, "_tensor", None)  # torchao's wrapper holds the fp32 tensor here
    if type(local).__name__ != "WeightWithDynamicFloat8CastTensor" or inner is None:
        return state
    if local is state:
        return inner
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(inner, state.device_mesh, state.placements, run_check=False,
                              shape=state.shape, stride=state.stride())
