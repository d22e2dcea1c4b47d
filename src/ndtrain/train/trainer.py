"""The Python API: `train(cfg)` runs a whole job (job.py) as `ndtrain train` does, and `Trainer`
is one rank's TrainState (build.py) with its step (step.py) and its logger, for tools, tests and
benchmarks that drive steps themselves: `Trainer(cfg).train_step()`. What the step trains with
is the state's: `trainer.state.model`, `trainer.state.loader`, ...; a field is changed there too
(`trainer.state.loader = ...`), which the step reads."""

from __future__ import annotations

from pathlib import Path

from ndtrain.config import JobConfig
from ndtrain.errors import NdtrainError
from ndtrain.train import job, step as steps
from ndtrain.train.build import build
from ndtrain.train.job import train  # noqa: F401  (the API's name: a whole job)
from ndtrain.train.metrics import measure_peaks, metrics_row
from ndtrain.train.pipeline_trace import save_pipeline_trace
from ndtrain.train.plan import Plan, as_written
from ndtrain.train.state import TrainState, checkpointer, full_weights
from ndtrain.train.step import StepResult, split_micro  # noqa: F401  (the API's names)


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path | None = None, log: bool = True, plan: Plan | None = None):
        """`plan`: the job resolved for this world (train/plan.py: resolve_plan, as train() and
        `ndtrain train` resolve it); its config is what trains. None: the config as written,
        no planner (as_written)."""
        from ndtrain.train import distributed

        world = distributed.setup(cfg.train).world_size
        self.plan = plan if plan is not None else as_written(cfg, world)
        if self.plan.world != world:
            raise NdtrainError(f"the plan was resolved for {self.plan.world} ranks but this run has "
                               f"{world}; resolve it for this world")
        self.state: TrainState = build(self.plan.config, self.plan.layout, host=self.plan.host)
        self.peaks = measure_peaks(self.state)
        self.logger = job.make_logger(self.plan.config, self.state.rt, run_dir, log)

    @property
    def step(self) -> int:
        return self.state.progress.step

    @property
    def tokens_seen(self) -> int:
        return self.state.progress.tokens_seen

    def checkpointer(self, run_dir: Path | None, cfg: JobConfig | None = None):
        """A Checkpointer of this trainer's state objects (`cfg`: other checkpoint settings)."""
        return checkpointer(self.state, run_dir, cfg, info=self.logger.info, record=self.logger.log)

    def train_step(self) -> StepResult:
        """One step, its values read at once: a caller driving steps one by one reads each (the
        job loop reads once per logging interval instead: step.read_steps)."""
        batch, wait = steps.next_batch(self.state)
        result = steps.train_step(self.state, batch, wait)
        steps.read_steps(self.state.unread)
        return result

    def validation_loss(self) -> float:
        return steps.validation_loss(self.state)

    def metrics_row(self, r: StepResult) -> dict:
        return metrics_row(r, self.peaks, self.tokens_seen, self.state.rt.device)

    def full_weights(self):
        return full_weights(self.state)

    def save_pipeline_trace(self, run_dir: Path) -> None:
        save_pipeline_trace(self.state, run_dir)

    def close(self) -> None:
        steps.close(self.state)
        self.logger.close()

