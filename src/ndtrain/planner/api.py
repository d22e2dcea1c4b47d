"""The planner as a library: `auto_layout` for `[parallel] auto = true`, and `predict` /
`predict_step_time` for comparing predictions with measured steps."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.model.config import ModelConfig
from ndtrain.layout import Layout, parse_layout
from ndtrain.layout.syntax import KEY_ALIASES
from ndtrain.planner.accelerator import Hardware
from ndtrain.planner.hardware import get_hardware, this_machine
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import Evaluator, Prediction, search


def _hardware(profile) -> Hardware:
    if profile is None:
        return this_machine()
    if isinstance(profile, Hardware):
        return profile
    if isinstance(profile, (os.PathLike, Path)) or str(profile).endswith(".json"):
        from ndtrain.planner import profile as profiles

        data = profiles.read_profile(profile)
        if profiles.is_gpu(data):  # a GPU's calibration: its catalog entry with what was measured
            return profiles.hardware_for(data.get("catalog", ""), str(profile))
        return this_machine(profile)
    return get_hardware(str(profile))


def _precision(hw: Hardware, precision: str | None) -> str:
    # The trainer computes in fp32 on CPU unless told otherwise (parallel.mixed_precision). fp8 on
    # hardware with no fp8 rate (this machine: its fp8 GEMMs are not calibrated) is priced as bf16.
    precision = precision or ("fp32" if hw.name == "this-machine" else "bf16")
    return "bf16" if precision == "fp8" and not hw.peak_fp8 else precision


def auto_layout(model_cfg: ModelConfig, world_size: int, seq_len: int, global_batch: int,
                micro_batch_options=(1, 2, 4, 8), hardware_profile=None, *, precision: str | None = None,
                zero_options=(1, 2, 3), ac_options=("none", "selective", "full"), schedules=None,
                base: Layout | None = None, fixed: dict | None = None) -> dict:
    """Pick the fastest layout the ndtrain runtime can build for `world_size` ranks.

    Arguments:
      model_cfg           the ModelConfig being trained.
      world_size          number of ranks.
      seq_len             tokens per sequence.
      global_batch        sequences per optimizer step (train.global_batch).
      micro_batch_options sequences per rank per forward/backward to consider.
      hardware_profile    None (this machine, from ~/.cache/ndtrain/hardware.json written by
                          `ndtrain calibrate`, defaults if absent), a path to such a JSON file, a
                          catalog name ("h100", "a100-80", ...) or a Hardware.
      precision           "fp32" | "bf16" | "fp8"; default fp32 on this machine, bf16 on GPUs.
      zero_options        ZeRO stages allowed when dp_shard x cp > 1 (the paper's stages, as the
                          runtime builds them).
      ac_options          activation-checkpoint policies allowed.
      schedules           pipeline schedules allowed (default: all six).
      base                the layout knobs the search keeps (mixed precision, compile, offload,
                          stage split...): their rules (ndtrain.layout.problems) apply.
      fixed               {Layout field: value} the search may not change (tp, pp, cp, ep, mb,
                          dp_shard, dp_replicate, zero): the defaults' data-parallel choice pins
                          every degree but the data-parallel ones.

    Only layouts ndtrain.layout.problems() accepts (strict: what the runtime builds) are searched;
    the search limits tp to one node.

    Returns a dict: "layout" (the ndtrain.layout.Layout chosen, with the planner's stage split as
    explicit layers_per_stage), "overrides" ({section: {key: value}}: every [parallel] key the
    choice sets, and train.micro_batch), the same keys flat for reading (dp_replicate, dp_shard,
    tp, cp, pp, ep, zero, reshard_after_forward, sequence_parallel, pp_schedule,
    pp_virtual_stages, pp_microbatches, layers_per_stage, activation_checkpoint, ac, micro_batch),
    plus the prediction: predicted_step_time (s), predicted_tokens_per_s, predicted_memory_bytes
    (peak on the fullest device), predicted_mfu, hardware (name).
    Raises NdtrainError when no layout fits in memory.
    """
    hw = _hardware(hardware_profile)
    pb = make_problem(model_cfg, seq_len, global_batch, world_size, hw, precision=_precision(hw, precision),
                      strict=True)
    res = search(pb, top_k=1, mb_options=sorted(set(int(m) for m in micro_batch_options)),
                 ac_options=tuple(ac_options), zero_options=tuple(zero_options),
                 schedules=tuple(schedules) if schedules else None, base=base, fixed=fixed)
    if not res.top:
        why = ""
        if res.fastest_over_cap:
            over = res.fastest_over_cap
            why = (f"; the closest, {over.layout.short()}, needs {over.memory['total'] / 2**30:.1f} GiB of "
                   f"{hw.hbm_bytes / 2**30:.1f} GiB")
        raise NdtrainError(f"no layout of {world_size} ranks fits this model, sequence and batch{why}")
    best = res.top[0]
    lay = best.layout
    if lay.pp > 1:  # the planner's whole choice reaches the runtime: its stage split and micro-batch count
        lay = dataclasses.replace(lay, layers_per_stage=tuple(best.time["stage_counts"]),
                                  pp_microbatches=lay.micro_batches(global_batch))
    wanted = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "zero", "reshard_after_forward", "sequence_parallel",
              "pp_schedule", "pp_virtual_stages", "pp_microbatches", "layers_per_stage", "activation_checkpoint",
              "micro_batch")
    overrides = lay.config_overrides(wanted)
    flat = {**overrides["parallel"], **overrides["train"]}
    flat["sequence_parallel"] = bool(lay.sequence_parallel and lay.tp > 1)
    return {
        "layout": lay, "overrides": overrides, **flat,
        "predicted_step_time": best.step_time, "predicted_tokens_per_s": best.tokens_per_s,
        "predicted_memory_bytes": best.memory["total"], "predicted_mfu": best.mfu, "hardware": hw.name,
    }


# Keys a layout dict may use; other `[parallel]` keys (compile, cp_attention, ...) do not change the
# prediction and are ignored, so a whole ParallelConfig can be passed as a dict.
PLANNER_KEYS = {"dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "zero", "micro_batch", "pp_virtual_stages",
                "activation_checkpoint", "sequence_parallel", "pp_schedule"}


def predict(model_cfg: ModelConfig, layout: dict | str, seq_len: int, global_batch: int, hardware=None,
            *, world: int | None = None, precision: str | None = None, stack: str = "ndtrain") -> Prediction:
    """Memory and step-time prediction for one layout.

    layout: a dict or `key=value,...` string over dp_replicate, dp_shard, tp, cp, pp, ep, zero,
    micro_batch, pp_virtual_stages, activation_checkpoint, sequence_parallel and pp_schedule (or
    their short forms, layout/syntax.KEY_ALIASES); other keys are ignored, except mixed_precision,
    which sets the precision when `precision` is not given.
    Unset degrees are 1 except dp_shard, which takes the rest of `world` (required then). The result's .time holds the breakdown (compute,
    recompute, exposed_comm with per-dimension comm, bubble, optimizer, total) in seconds and
    .memory the per-device bytes.
    """
    pb, lay = _problem(model_cfg, layout, seq_len, global_batch, hardware, world, precision, stack)
    return Evaluator(pb)(lay)


def predict_step_time(model_cfg: ModelConfig, layout: dict | str, seq_len: int, global_batch: int,
                      hardware=None, **kw) -> float:
    """Predicted seconds per optimizer step (see `predict` for the arguments and the breakdown)."""
    return predict(model_cfg, layout, seq_len, global_batch, hardware, **kw).step_time


def compile_decision(model_cfg: ModelConfig, layout: Layout, seq_len: int, global_batch: int, steps: int,
                     hardware_profile=None, precision: str = "bf16") -> dict | None:
    """Whether torch.compile of the blocks repays its cold compile within `steps` for this resolved
    layout (planner/compile_choice.py); None where the planner cannot price it."""
    from ndtrain.planner.compile_choice import compile_choice

    hw = _hardware(hardware_profile)
    pb = make_problem(model_cfg, seq_len, global_batch, layout.world, hw, precision=_precision(hw, precision))
    return compile_choice(pb, layout, steps)


def _problem(model_cfg: ModelConfig, layout: dict | str, seq_len: int, global_batch: int, hardware,
             world: int | None, precision: str | None, stack: str):
    """predict's problem and layout, from its arguments."""
    hw = _hardware(hardware)
    if isinstance(layout, dict):
        layout = {KEY_ALIASES.get(k, k): v for k, v in layout.items()}
        if precision is None and "mixed_precision" in layout:
            precision = layout["mixed_precision"]
        layout = {k: (int(v) if isinstance(v, bool) else v) for k, v in layout.items() if k in PLANNER_KEYS}
        if "dp_shard" not in layout or int(layout.get("dp_shard", -1)) == -1:
            if world is None:
                raise NdtrainError("predict: give dp_shard or world")
    else:
        if world is None and "dp_shard=" not in layout:
            raise NdtrainError("predict: give dp_shard or world")
    lay = parse_layout(layout, world)
    if lay.activation_checkpoint not in ("none", "selective", "full"):
        raise NdtrainError(f"predict: activation checkpoint {lay.activation_checkpoint!r} is not modelled")
    pb = make_problem(model_cfg, seq_len, global_batch, world or lay.world, hw, stack=stack,
                      precision=_precision(hw, precision))
    return pb, lay


def predict_collective_bytes(model_cfg: ModelConfig, layout: dict | str, seq_len: int, global_batch: int,
                             hardware=None, *, world: int | None = None, precision: str | None = None,
                             stack: str = "ndtrain") -> dict[str, dict[str, float]]:
    """Bytes per step of each collective on each mesh dimension, on the device holding the first
    pipeline stage (planner/traffic.py), for the layout `predict` takes."""
    from ndtrain.planner.traffic import collective_bytes

    pb, lay = _problem(model_cfg, layout, seq_len, global_batch, hardware, world, precision, stack)
    counts = Evaluator(pb)(lay).time["stage_counts"]
    return collective_bytes(pb, lay, sum(counts[::lay.pp]) if lay.pp > 1 else pb.shape.layers)
