"""One training job around a Trainer: resume, the loop with its recovery guard (watchdog,
non-finite rollback, stragglers, preemption), logging, checkpoints, validation and the closing
sample; a dead peer or Ctrl-C becomes one clear error. trainer.train() resolves the plan, claims the run
directory and calls `run` with the plan and a way to build its Trainer (so this module does not
import trainer.py)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ndtrain.config import JobConfig, to_toml
from ndtrain.layout.flops import MFU_CONVENTION
from ndtrain.model.config import num_params
from ndtrain.train import distributed, recovery, resilience
from ndtrain.train.checkpoint import list_checkpoints
from ndtrain.train.distributed import group_active

SAMPLE_DELAY_ENV = "NDTRAIN_TEST_SAMPLE_DELAY_S"  # tests only: seconds rank 0 sleeps before its sample
# tests only: seconds rank 0 sleeps after its last collective, before the teardown (what a slow
# tracker flush or W&B finish does there)
END_DELAY_ENV = "NDTRAIN_TEST_END_DELAY_S"


def run(plan, run_dir: Path, make_trainer: Callable[[], object]) -> dict:
    """Train `plan` (train/plan.py: the job resolved for this world) in `run_dir` (already claimed)
    with the Trainer `make_trainer()` builds of it; a dead peer or Ctrl-C becomes one clear error."""
    cfg = plan.config
    peers = distributed.peer_table()  # who is who, should a peer die later
    progress = {"step": None}
    interrupt = recovery.InterruptRecord()
    try:
        summary = _loop(plan, run_dir, progress, make_trainer)
    except KeyboardInterrupt:
        raise recovery.Interrupted(progress["step"]) from None
    except Exception as exc:
        if peers:
            from ndtrain.errors import RunError

            # A peer that stopped on Ctrl-C looks dead from here, and so does a checkpoint write
            # it left half done (reported as a failed write); this rank's own signal is on its way
            # (a launcher signals its workers one by one): wait for it. A SIGTERM now is the
            # launcher stopping the group after the death: say what happened, then go.
            recovery.hold_sigterm()
            try:
                time.sleep(1.0)
            except KeyboardInterrupt:
                pass
            if interrupt.seen:
                raise recovery.Interrupted(progress["step"]) from None
            if distributed.is_peer_failure(exc):
                raise RunError(distributed.peer_failure_message(exc, peers, torch.distributed.get_rank())) from None
        raise
    finally:
        interrupt.close()
    if not group_active():  # one process: nobody waits on this one, and the trainer is gone
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
    time.sleep(float(os.environ.get(SAMPLE_DELAY_ENV, "0") or 0))  # tests: a slow rank 0
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


def _loop(plan, run_dir: Path, progress: dict, make_trainer) -> dict:
    cfg = plan.config
    trainer = make_trainer()
    # Every checkpoint records this config: with the data path absolute, `ndtrain generate
    # --checkpoint` finds a BPE tokenizer from any working directory (byte needs no file).
    cfg.data.path = os.path.abspath(cfg.data.path)
    rt, log = trainer.rt, trainer.logger
    ckpt = trainer.checkpointer(run_dir)
    if rt.is_main:
        from ndtrain.train.run_files import write_run_file

        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_file(run_dir / "config.toml", to_toml(cfg))  # by rename: never through a link
        # What this attempt was resolved to (train/plan.py): the layout and the planner's choices
        write_run_file(run_dir / "plan.json", json.dumps(plan.as_dict(), indent=1) + "\n")
    for spec in recovery.resume_specs(cfg):  # a torchrun restart tries "auto" first
        if ckpt.resume(spec) is not None:
            break
    log.start(trainer.step)
    if rt.is_main and (change := resilience.membership_change(run_dir, rt.world_size, trainer.dims.describe())):
        log.log({"step": trainer.step, **change[0]})  # the previous attempt excluded a host: old and new layout
        log.info(change[1])
    # Each attempt's first row: the report marks restarts and changes of world or layout by it.
    log.log({"step": trainer.step, "event": "restart" if ckpt.loaded_from or recovery.restart_count() else "start",
             "attempt": recovery.restart_count(), "world": rt.world_size, "layout": trainer.dims.describe(),
             "tokens_seen": trainer.tokens_seen, "resumed_from": str(ckpt.loaded_from or "") or None,
             "plan": plan.as_dict()})
    log.info(f"ndtrain: {cfg.model.preset} model, {num_params(cfg.model) / 1e6:.2f}M parameters, "
             f"layout {trainer.dims.describe()} on {rt.world_size} x {rt.device.type}, "
             f"peak {trainer.peak_flops_total / 1e9:.1f} GFLOP/s ({trainer.peak_source}"
             + (f" bf16; fp8 {trainer.peak_fp8_total / 1e9:.1f} GFLOP/s {trainer.peak_fp8_source}" if trainer.fp8 else "")
             + f"); run dir {run_dir}")
    log.info(f"{MFU_CONVENTION}: {trainer.flops_per_token / 1e6:.2f} MFLOP/token")
    if trainer.fp8:
        from ndtrain.layout.fp8 import fp8_linears, summary

        log.info(f"fp8 ({cfg.parallel.fp8_recipe} scaling): {len(fp8_linears(cfg.model, trainer.dims.tp))} "
                 f"Linear layers in float8 ({summary(cfg.model, trainer.dims.tp)}); all else bf16")
    if plan.compile is not None:
        c = plan.compile
        log.info(c.description)
        log.log({"step": trainer.step, "event": "compile_auto", "compile": c.compile, "eager_step_s": c.eager_step_s,
                 "compiled_step_s": c.compiled_step_s, "compile_s": c.compile_s, "breakeven_steps": c.breakeven_steps})
    if plan.prediction is not None:  # the planner chose the layout
        log.info(f"layout chosen by the planner: {plan.explanation}")
        log.log({"step": trainer.step, "event": "auto", "layout": plan.explanation,
                 "predicted_step_time": plan.prediction.step_s, "predicted_tokens_per_s": plan.prediction.tokens_per_s})
    step_times: list[float] = []
    last_val, preempted, interrupted, path = None, False, False, None
    guard = recovery.Recovery(cfg, trainer, ckpt, run_dir)  # watchdog, non-finite rollback, stragglers
    try:
        while trainer.step < cfg.train.steps and guard.leave is None:  # leave: a host refused at start
            guard.before_step()
            trace = trainer.pipeline is not None and trainer.step + 1 == cfg.logging.pipeline_trace_step
            if trace:
                trainer.pipeline.trace = True
            result = trainer.train_step()
            for row in trainer.diloco.take_rows() if trainer.diloco else ():  # outer steps
                log.log(row)
            progress["step"] = trainer.step
            if trace:
                trainer.save_pipeline_trace(run_dir)
            action = guard.after_step(result)
            if action == "rollback":
                continue
            step_times.append(result.seconds)
            if result.step % cfg.train.log_interval == 0 or result.step == cfg.train.steps:
                row = trainer.metrics_row(result)
                row["last"] = result.step == cfg.train.steps
                row["time"] = time.time()
                log.log(row)
            if cfg.train.val_interval and (result.step % cfg.train.val_interval == 0 or result.step == cfg.train.steps):
                last_val = trainer.validate()
                log.log({"step": result.step, "val_loss": last_val})
            if action == "leave":  # a host is taken out (resilience.py): save, then the group re-forms
                break
            if action == "stop":
                preempted = True
                log.info(f"stop requested (SIGTERM/SIGUSR1) at step {trainer.step}: saving, then exiting; "
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
        guard.close()
    if plan.prediction is not None and len(step_times) > 3:
        measured = statistics.median(step_times[3:])  # the first steps pay for warm-up
        note = plan.prediction.uncalibrated  # said in the same line: how far an uncalibrated plan may be off
        log.info(f"planned layout: measured {measured:.3f} s/step vs predicted "
                 f"{plan.prediction.step_s:.3f} s/step" + (f" ({note})" if note else ""))
    summary = {"run_dir": str(run_dir), "steps": trainer.step, "val_loss": last_val, "checkpoint": str(path),
               "preempted": preempted, "interrupted": interrupted,
               "stop_signal": guard.preemption.signal_name if preempted else "", "leave": guard.leave}
    if rt.is_main and cfg.train.sample_tokens > 0 and path is not None and not (preempted or interrupted or guard.leave):
        # Only rank 0 samples, so not now: the other ranks would wait for it in a collective under
        # the collective timeout. closing_sample runs once no rank can be waiting.
        summary["sample_from"] = {"checkpoint": str(path), "device": str(rt.device),
                                  "verified": ckpt.verdicts.get(str(path), "unknown") is None}
    if rt.is_main:
        time.sleep(float(os.environ.get(END_DELAY_ENV, "0") or 0))  # tests: rank 0 slow to close
    trainer.close()
    return summary
