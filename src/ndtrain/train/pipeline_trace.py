"""A traced pipeline step: every F/B/W action of the pipeline's schedule timed on each rank, for
`ndtrain report`'s Gantt chart (logging.pipeline_trace_step in a run) and `ndtrain pipeline-report`
(trace_steps)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ndtrain.train.state import TrainState
from ndtrain.train.step import next_batch, train_step


def trace_next_step(state: TrainState, trace_step: int) -> bool:
    """Whether the next step is the pipeline step to trace (logging.pipeline_trace_step); if so,
    the pipeline starts timing its actions."""
    if state.pipeline is None or state.progress.step + 1 != trace_step:
        return False
    state.pipeline.trace = True
    return True


def _rank_trace(state: TrainState, last: int) -> dict:
    """This rank's {"rank", "stages" (its stage indices), "traces" (the `last` steps' timed
    actions)}; the pipeline stops timing."""
    pipeline = state.pipeline
    trace = {"rank": state.rt.rank, "stages": [s.stage_index for s in pipeline.stages],
             "traces": pipeline.traces[-last:]}
    pipeline.trace, pipeline.traces = False, []
    return trace


def trace_steps(state: TrainState, steps: int) -> dict:
    """Train `steps` steps with every pipeline action timed: this rank's trace (as
    save_pipeline_trace gathers it, one timeline per step) and "losses" (`ndtrain pipeline-report`)."""
    state.pipeline.trace = True
    losses = [train_step(state, *next_batch(state)).loss for _ in range(steps)]
    return {**_rank_trace(state, steps), "losses": losses}


def save_pipeline_trace(state: TrainState, run_dir: Path) -> None:
    """Every rank's timed F/B/W actions of the step just traced, gathered into rank 0's
    `pipeline_trace.json` (the input of `ndtrain report`'s Gantt chart)."""
    rt = state.rt
    trace = _rank_trace(state, 1)
    gathered = [None] * rt.world_size
    torch.distributed.all_gather_object(gathered, trace)
    if rt.is_main:
        from ndtrain.train.run_files import write_run_file

        lay = state.layout
        write_run_file(run_dir / "pipeline_trace.json", json.dumps(
            {"step": state.progress.step, "schedule": lay.pp_schedule, "p": lay.pp, "v": lay.pp_virtual_stages,
             "ranks": gathered}))
