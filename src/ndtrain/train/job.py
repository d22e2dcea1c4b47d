"""One training job, `train(cfg)`: resolve the plan (plan.py), claim the run directory, build the
state (build.py), then own what runs around its steps (step.py) and hand each what it needs: the
logger, the checkpointer (resume, saves), the recovery guard (watchdog, non-finite rollback,
stragglers, preemption), the signals (signals.py), the job hooks (hooks.py), validation and the
closing sample; a dead peer or Ctrl-C becomes one clear error. `ndtrain train` and the Python
API (trainer.py) both call `train`."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from ndtrain.config import JobConfig, to_toml
from ndtrain.layout.flops import MFU_CONVENTION
from ndtrain.model.config import num_params
from ndtrain.train import distributed, hooks, recovery, resilience, signals, step as steps
from ndtrain.train.balance import Balancer
from ndtrain.train.build import build
from ndtrain.train.checkpoint import list_checkpoints
from ndtrain.train.gc_schedule import GcSchedule
from ndtrain.train.distributed import env_world_size, group_active
from ndtrain.train.metrics import compute_modules, measure_peaks, metrics_row
from ndtrain.train.optim import extend_schedule
from ndtrain.train.pipeline_trace import save_pipeline_trace, trace_next_step
from ndtrain.train.noise_scale import grow
from ndtrain.train.plan import Plan, resolve_plan
from ndtrain.train.state import checkpointer


def train(cfg: JobConfig, plan: Plan | None = None) -> dict:
    """Run a whole job: train, validate, checkpoint, sample. Returns a summary (rank 0's view).
    `plan`: the job resolved for this world; by default resolved here (train/plan.py), so
    `ndtrain train` and the Python API build the same run. `cfg` is not changed: the run trains
    with the plan's config."""
    from ndtrain.train.rundir import claim_for_group, group_run_dir

    plan = plan if plan is not None else resolve_plan(cfg, env_world_size())
    run_dir = group_run_dir(plan.config)
    lock = claim_for_group(plan.config, run_dir)
    try:
        return run(plan, run_dir)
    finally:
        if lock is not None:
            lock.release()


def run(plan: Plan, run_dir: Path) -> dict:
    """Train `plan` (train/plan.py: the job resolved for this world) in `run_dir` (already
    claimed); a dead peer or Ctrl-C becomes one clear error."""
    cfg = plan.config
    peers = distributed.peer_table()  # who is who, should a peer die later
    reached = {"step": None}  # the last step done, for the Ctrl-C line
    interrupt = signals.InterruptRecord()
    try:
        summary = _loop(plan, run_dir, reached)
    except KeyboardInterrupt:
        raise signals.Interrupted(reached["step"]) from None
    except Exception as exc:
        if peers:
            from ndtrain.errors import RunError

            # A peer that stopped on Ctrl-C looks dead from here, and so does a checkpoint write
            # it left half done (reported as a failed write); this rank's own signal is on its way
            # (a launcher signals its workers one by one): wait for it. A SIGTERM now is the
            # launcher stopping the group after the death: say what happened, then go.
            signals.hold()
            try:
                time.sleep(1.0)
            except KeyboardInterrupt:
                pass
            if interrupt.seen:
                raise signals.Interrupted(reached["step"]) from None
            if distributed.is_peer_failure(exc):
                raise RunError(distributed.peer_failure_message(exc, peers, torch.distributed.get_rank())) from None
        raise
    finally:
        interrupt.close()
    if not group_active():  # one process: nobody waits on this one, and the state is gone
        closing_sample(cfg, summary)
    return summary


def closing_sample(cfg: JobConfig, summary: dict) -> None:
    """Rank 0's sample of the final checkpoint, run when no other rank can be waiting on it: after
    the process groups are torn down (command._run), or at once with no group. On the run's
    device, with a KV cache, from a checkpoint this run has just hashed (not hashed again);
    skipped in one line when the model does not fit. Sets summary["sample"]."""
    request = summary.pop("sample_from", None)
    if not request:
        return
    from ndtrain.errors import NdtrainError
    from ndtrain.train.generate import does_not_fit, generate_from_checkpoint, sample_device

    t = cfg.train
    device = sample_device(request["device"])
    why = does_not_fit(cfg.model, device, len(t.sample_prompt.encode()) + t.sample_tokens)
    if why is None:
        try:
            text = generate_from_checkpoint(request["checkpoint"], t.sample_prompt, t.sample_tokens, seed=t.seed,
                                            device=device, verified=request["verified"])
        except (NdtrainError, torch.OutOfMemoryError, MemoryError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        else:
            print("---- sample ----\n" + text + "\n----------------", flush=True)
            summary["sample"] = text
            return
    print(f"sample skipped: {why} (train.sample_tokens=0 turns it off; `ndtrain generate --checkpoint "
          f"{request['checkpoint']}` samples it on a machine that holds it)", flush=True)


def make_logger(cfg: JobConfig, rt, run_dir: Path | None, log: bool = True):
    """The run's metrics logger (metrics.jsonl and the trackers), enabled on rank 0 of a run with
    a directory. Every rank checks the trackers' packages: a missing one stops all of them."""
    from ndtrain.config import to_dict
    from ndtrain.train.metrics import MetricsLogger
    from ndtrain.train.trackers import check_installed

    if log and run_dir is not None:
        check_installed(cfg.logging)
    return MetricsLogger(run_dir, log and rt.is_main and run_dir is not None, cfg.train.steps, cfg.logging.progress,
                         cfg.logging, to_dict(cfg))


def _loop(plan: Plan, run_dir: Path, reached: dict) -> dict:
    cfg = plan.config
    state = build(cfg, plan.layout, host=plan.host)
    peaks = measure_peaks(state)
    rt, layout, progress = state.rt, plan.layout, state.progress  # what the job hands on
    log = make_logger(cfg, rt, run_dir)
    # Every checkpoint records this config: with the data path absolute, `ndtrain generate
    # --checkpoint` finds a BPE tokenizer from any working directory (byte needs no file).
    cfg.data.path = os.path.abspath(cfg.data.path)
    ckpt = checkpointer(state, run_dir, info=log.info, record=log.log)
    _start(plan, run_dir, progress, rt, ckpt, log, peaks)
    times = StepTimes()
    last_val, preempted, interrupted, path = None, False, False, None
    job_hooks = hooks.load(rt.rank, run_dir)  # tests and drills: faults at the step and checkpoint points
    ckpt.set_fault_hook(lambda point, step: job_hooks.at_checkpoint(step, point))
    guard = recovery.Recovery(cfg, run_dir, rt=rt, progress=progress, loader=state.loader, ckpt=ckpt,
                              logger=log, compute=compute_modules(state.model_parts), layout=layout.describe())
    gc_schedule = GcSchedule(cfg.train.gc_every).start()  # every rank collects on the same steps
    balancer = Balancer(state) if cfg.parallel.balance == "measured" else None
    try:
        while progress.step < cfg.train.steps and guard.leave is None:  # leave: a host refused at start
            guard.before_step()
            job_hooks.at_step(progress.step + 1)
            if balancer and (said := balancer.sync()):  # the checkpoint's shares (a resume, a rollback)
                log.info(said)
            trace = trace_next_step(state, cfg.logging.pipeline_trace_step)
            batch, wait = steps.next_batch(state)
            result = steps.train_step(state, batch, wait)
            gc_schedule.after_step(result.step)
            for row in result.rows:  # DiLoCo's outer steps
                log.log(row)
            reached["step"] = progress.step
            if trace:
                save_pipeline_trace(state, run_dir)
            last = result.step == cfg.train.steps
            logged = result.step % cfg.train.log_interval == 0 or last
            # The step's loss, norm and skip flag stay on the device until a logging step or a
            # checkpoint reads every unread step at once (step.read_steps): one sync per interval.
            action = guard.after_step(result, read=logged or ckpt.due(result.step))
            if action == "rollback":
                times.undo()
                continue
            job_hooks.after_step(result)
            times.add(result)
            if logged:
                log.log({**metrics_row(result, peaks, progress.tokens_seen, rt.device), "last": last,
                         "time": time.time()})
            if cfg.train.val_interval and (result.step % cfg.train.val_interval == 0 or last):
                last_val = steps.validation_loss(state)
                log.log({"step": result.step, "val_loss": last_val})
            if ckpt.due(result.step):  # decided before any save there (a stop's too): the checkpoint records it
                _at_checkpoint_boundary(cfg, progress, result, balancer, log)
            if action == "leave":  # a host is taken out (resilience.py): save, then the group re-forms
                break
            if action == "stop":
                preempted = True
                log.info(f"stop requested (SIGTERM/SIGUSR1) at step {progress.step}: saving, then exiting; "
                         f"continue with --checkpoint.resume=auto")
                break
            if ckpt.due(result.step):
                ckpt.save()
        path = ckpt.save(final=True)
        ckpt.finish()
    except KeyboardInterrupt:  # Ctrl-C: stop now, save nothing more (a save in flight finishes on its own)
        interrupted = True
        published = list_checkpoints(ckpt.root)
        path = published[-1] if published else None
    finally:
        gc_schedule.stop()
        if balancer:
            balancer.close()
        job_hooks.close()
        guard.close()
    _measured_against_plan(plan, times.final, log)
    # How this attempt ended (a crash writes nothing): the report tells a user's resume after it
    # from a failure's restart.
    log.log({"step": progress.step, "event": "end", "how": "interrupted" if interrupted else "stopped" if preempted
             else "left" if guard.leave else "finished"})
    summary = {"run_dir": str(run_dir), "steps": progress.step, "val_loss": last_val, "checkpoint": str(path),
               "preempted": preempted, "interrupted": interrupted,
               "stop_signal": guard.preemption.signal_name if preempted else "", "leave": guard.leave}
    if rt.is_main and cfg.train.sample_tokens > 0 and path is not None and not (preempted or interrupted or guard.leave):
        # Only rank 0 samples, so not now: the other ranks would wait for it in a collective under
        # the collective timeout. closing_sample runs once no rank can be waiting.
        summary["sample_from"] = {"checkpoint": str(path), "device": str(rt.device),
                                  "verified": ckpt.verdicts.get(str(path), "unknown") is None}
    steps.close(state)
    log.close()
    return summary


class StepTimes:
    """The measured step times. A step returns before its device work is done; its time is final
    once it is read (step.read_steps adds its share of the wait), so a step waits in
    `pending` until then."""

    def __init__(self):
        self.final: list[float] = []
        self.pending: list = []

    def add(self, result) -> None:
        self.pending.append(result)
        if not result.unread:  # read, and every step before it
            self.final += [r.seconds for r in self.pending]
            self.pending.clear()

    def undo(self) -> None:
        """A rollback: the steps not read yet are undone."""
        self.pending.clear()


def _at_checkpoint_boundary(cfg: JobConfig, progress, result, balancer: Balancer | None, log) -> None:
    """What changes only where a checkpoint falls, decided before any save there so that the
    checkpoint records it and a resume continues alike: batch_ramp = "auto"'s next batch, and the
    measured balance's new shares."""
    if cfg.train.batch_ramp == "auto":
        said = grow(cfg, progress, result.extra.get("grad_noise_scale"), result.extra["global_batch"])
        if said:
            log.info(said)
    if balancer and (change := balancer.at_boundary()):
        log.log(change[0])
        log.info(change[1])


def _measured_against_plan(plan: Plan, step_times: list[float], log) -> None:
    """Where the planner chose the layout: its predicted step time against the measured one."""
    if plan.prediction is None or len(step_times) <= 3:
        return
    measured = statistics.median(step_times[3:])  # the first steps pay for warm-up
    note = plan.prediction.uncalibrated  # said in the same line: how far an uncalibrated plan may be off
    log.info(f"planned layout: measured {measured:.3f} s/step vs predicted "
             f"{plan.prediction.step_s:.3f} s/step" + (f" ({note})" if note else ""))


def _start(plan, run_dir: Path, progress, rt, ckpt, log, peaks) -> None:
    """Before the first step: the run files, the resume, and the lines and rows that say what
    this attempt is (its layout, peak, fp8 layers, the planner's choices)."""
    cfg, layout = plan.config, plan.layout
    if rt.is_main:
        from ndtrain.train.run_files import write_run_file

        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_file(run_dir / "config.toml", to_toml(cfg))  # by rename: never through a link
        # What this attempt was resolved to (train/plan.py): the layout and the planner's choices
        write_run_file(run_dir / "plan.json", json.dumps(plan.as_dict(), indent=1) + "\n")
    for spec in recovery.resume_specs(cfg):  # a torchrun restart tries "auto" first
        if ckpt.resume(spec) is not None:
            break
    if (extended := extend_schedule(cfg, progress)) and rt.is_main:  # train.steps changed on a resume
        log.info(extended)
    log.start(progress.step)
    # Each attempt's first row: the report marks restarts, resumes (a new launch) and changes of
    # world or layout by it.
    start = {"step": progress.step, "event": "restart" if ckpt.loaded_from or recovery.restart_count() else "start",
             "attempt": recovery.restart_count(), "launch": resilience.launch_id(), "world": rt.world_size,
             "layout": layout.describe(), "tokens_seen": progress.tokens_seen,
             "resumed_from": str(ckpt.loaded_from or "") or None, "plan": plan.as_dict()}
    if rt.is_main and (change := resilience.membership_change(run_dir, rt.world_size, layout.describe(), start)):
        log.log({"step": progress.step, **change[0]})  # the previous attempt excluded a host: old and new layout
        log.info(change[1])
    log.log(start)
    log.info(f"ndtrain: {cfg.model.preset} model, {num_params(cfg.model) / 1e6:.2f}M parameters, "
             f"layout {layout.describe()} on {rt.world_size} x {rt.device.type}, "
             f"peak {peaks.total / 1e9:.1f} GFLOP/s ({peaks.source}"
             + (f" bf16; fp8 {peaks.fp8_total / 1e9:.1f} GFLOP/s {peaks.fp8_source}" if peaks.fp8 else "")
             + f"); run dir {run_dir}")
    log.info(f"{MFU_CONVENTION}: {peaks.flops_per_token / 1e6:.2f} MFLOP/token")
    if peaks.fp8:
        from ndtrain.layout.fp8 import fp8_linears, fp8_summary

        log.info(f"fp8 ({cfg.parallel.fp8_recipe} scaling): {len(fp8_linears(cfg.model, layout.tp))} "
                 f"Linear layers in float8 ({fp8_summary(cfg.model, layout.tp)}); all else bf16")
    if plan.compile is not None:
        c = plan.compile
        log.info(c.description)
        log.log({"step": progress.step, "event": "compile_auto", "compile": c.compile, "eager_step_s": c.eager_step_s,
                 "compiled_step_s": c.compiled_step_s, "compile_s": c.compile_s, "breakeven_steps": c.breakeven_steps})
    if plan.prediction is not None:  # the planner chose the layout
        log.info(f"layout chosen by the planner: {plan.explanation}")
        log.log({"step": progress.step, "event": "auto", "layout": plan.explanation,
                 "predicted_step_time": plan.prediction.step_s, "predicted_tokens_per_s": plan.prediction.tokens_per_s})
    from ndtrain.train.run_length import start_line

    if line := start_line(plan, progress.step):  # how long this attempt takes, said before its first step
        log.info(line)
