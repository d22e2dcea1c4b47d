"""Whether torch.compile of the decoder blocks repays its compile time within a run: the rule
behind `[parallel] compile_auto`.

Compiled blocks train faster per step (fused elementwise kernels, fewer host calls) but the
first step pays a cold compile: ~18 s per kind of block on the 2-core CPU host of
docs/results/benchmarks.md, estimated at ~60 s on a GPU host (hardware.py: compile_s). Compile pays
when the run's steps times the per-step saving the planner predicts exceed that cost:

    compile  <=>  steps x (eager step - compiled step) > kinds of block x compile_s

Both step times come from the same model that ranks layouts (Evaluator): on a GPU the fused
elementwise kernels (kappa_fused against kappa_eager); on CPU ranks the fraction of a layer
compiled blocks measured saving there (hardware.py: cpu_compile_saving). Where the planner
cannot price it (no compile time known, as on uncalibrated CPU ranks; a layout the compile rules
refuse; a recompute policy it does not model) there is no decision and compile stays as set.
A profile that says compile was never measured (one fitted to runs that did not compile:
hardware.compile_unmeasured) decides "off" and says why, so the start-up line names the gap.

Tensor-parallel layouts are priced like any other: the saving is the blocks' local compute
(layer.py), their TP collectives cost the same compiled or not. Which TP layouts compile is the
rules' answer alone (layout/rules.py, tensor_parallel: not full checkpointing),
so compile_auto never picks a compiled layout the runtime would refuse.
"""

from __future__ import annotations

import dataclasses
import math

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout
from ndtrain.planner.problem import Problem
from ndtrain.planner.search import Evaluator
from ndtrain.planner.stack import PLANNED_AC


def block_kinds(pb: Problem) -> int:
    """Distinct block graphs torch.compile traces: dense and MoE layers compile separately."""
    return len({pb.cfg.is_moe_layer(i) for i in range(pb.cfg.n_layers)})


def compile_choice(pb: Problem, lay: Layout, steps: int) -> dict | None:
    """{"compile": bool, "eager_step_s", "compiled_step_s", "compile_s" (the run's cold compile
    cost), "breakeven_steps" (None when compiling saves nothing), "steps", "description"}; None
    where the planner cannot price it. Where the profile says compile was never measured: off,
    the compiled step the eager one, no breakeven, and the description says why."""
    unpriced = pb.hw.compile_s <= 0 and not pb.hw.compile_unmeasured
    if lay.activation_checkpoint not in PLANNED_AC or steps < 1 or unpriced:
        return None
    ev = Evaluator(pb)
    if pb.hw.compile_s <= 0:  # the profile says compile was not measured: off, and why
        try:
            eager = ev(dataclasses.replace(lay, compile=False)).step_time
        except NdtrainError:
            return None
        return {"compile": False, "eager_step_s": eager, "compiled_step_s": eager, "compile_s": 0.0,
                "breakeven_steps": None, "steps": steps,
                "description": f"torch.compile off: {pb.hw.compile_unmeasured} (on {pb.hw.name})"}
    try:
        eager = ev(dataclasses.replace(lay, compile=False)).step_time
    except NdtrainError:  # a layout the runtime refuses
        return None
    try:
        compiled = ev(dataclasses.replace(lay, compile=True)).step_time
    except NdtrainError as e:  # compiled blocks the runtime refuses here (a zero-bubble schedule): off, and why
        why = str(e).split(": ", 1)[-1].split(";")[0]
        return {"compile": False, "eager_step_s": eager, "compiled_step_s": eager, "compile_s": 0.0,
                "breakeven_steps": None, "steps": steps,
                "description": f"torch.compile off: {why} (on {pb.hw.name})"}
    cost = block_kinds(pb) * pb.hw.compile_s
    saved = eager - compiled
    breakeven = math.ceil(cost / saved) if saved > 0 else None
    on = breakeven is not None and steps > breakeven
    if breakeven is None:
        why = "compiled blocks are predicted no faster here"
    else:
        why = (f"it saves a predicted {saved * 1e3:.1f} ms/step ({eager:.3f} -> {compiled:.3f} s) and repays "
               f"its ~{cost:.0f} s cold compile after {breakeven:,} steps; the run has {steps:,}")
    return {"compile": on, "eager_step_s": eager, "compiled_step_s": compiled, "compile_s": cost,
            "breakeven_steps": breakeven, "steps": steps,
            "description": f"torch.compile {'on' if on else 'off'}: {why} (on {pb.hw.name})"}
