"""One optimizer step of a TrainState, and what surrounds it: the step's batch, validation, the
metrics row, a pipeline trace. `train_step(state, batch) -> StepResult` branches on the layout
only where a dimension adds work: pipeline (pp > 1: the schedule runs the micro-batches),
context parallel (cp > 1: a share of each sequence), tensor parallel (tp > 1: the vocab-parallel
loss), FSDP (gradient sync per micro-batch) and fp8; and on the data for document masking.

The step reads no device value on the host: on a GPU each read (`float(t)`, `.item()`,
`.tolist()`, `if t`) waits for every kernel queued before it and leaves the device idle while the
host catches up. Its loss, gradient norm and skip flag stay on the device (step_values.py) until
the job loop reads them, once per logging interval; clipping and the non-finite skip act on the
device (`update`), as does the MoE bias update; the MoE metrics are read with the step's values."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ndtrain.compat.torch import skips_on_device, step_unless
from ndtrain.config import global_batch_at
from ndtrain.data.loader import IGNORE, validation_batches
from ndtrain.data.mixture import open_dataset
from ndtrain.data.packing import document_ids, document_positions
from ndtrain.errors import ConfigError
from ndtrain.layout.flops import flops_per_token
from ndtrain.model.moe import set_aux_scale, step_metrics as moe_metrics, step_statistics as moe_statistics
from ndtrain.parallel.data_parallel import accumulation, reshard
from ndtrain.parallel.grad_norm import (all_reduce_sum, all_reduce_tensor, clip_scale, local_grad_sq,
                                        reduce_partial_grads, scale_grads)
from ndtrain.train.metrics import mfu, peak_memory_mb, raise_peak, reset_peak_memory, run_peaks
from ndtrain.train.noise_scale import NoiseScale, small_batch, unsupported
from ndtrain.train.optim import batch_lr_scale, extend_schedule, lr_at, set_lr
from ndtrain.train.state import TrainState
from ndtrain.train.step_values import (APPLIED, GRAD_NORM, GRAD_SQ, SMALL_SQ, WIDTH, StepResult,  # noqa: F401
                                       read_steps)


def split_micro(n: int, micro: int) -> list[tuple[int, int]]:
    """[start, end) slices of at most `micro` rows. Loss is normalised by tokens, so an uneven
    last micro-batch (after an elastic shrink) is still exact."""
    return [(s, min(s + micro, n)) for s in range(0, n, micro)]


# ---- the step's input ------------------------------------------------------------------------
def next_batch(state: TrainState):
    """(this rank's share of the step's batch, seconds waited for it). Its size is the batch
    rule's for the tokens seen so far (layout/rules.py checked it splits over dp)."""
    t0 = time.perf_counter()
    batch = state.loader.next_batch(global_batch_at(state.cfg, state.progress.tokens_seen, state.progress.batch_points))
    return batch, time.perf_counter() - t0  # ~0 when prefetching keeps ahead of the step


def _loss_context(state: TrainState):
    if state.layout.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _autocast(state: TrainState):
    if state.autocast:
        return torch.autocast(state.rt.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _to_device(state: TrainState, t: torch.Tensor) -> torch.Tensor:
    return t.to(state.rt.device, non_blocking=True)  # from pinned memory on a GPU: an async copy


def cp_shard(state: TrainState, t: torch.Tensor) -> torch.Tensor:
    """This cp rank's tokens of [batch, seq] inputs or targets."""
    if state.layout.cp == 1:
        return t
    from ndtrain.parallel.context import shard_sequence

    return shard_sequence(t, state.layout.cp, state.cp_rank)


def doc_inputs(state: TrainState, inputs: torch.Tensor) -> dict | None:
    """Document ids and per-document positions of full [batch, seq] inputs, cp-sharded like the
    tokens (None without document masking)."""
    if not state.layout.doc_mask:
        return None
    doc = document_ids(inputs, state.train_set.eos_id)
    return {"positions": cp_shard(state, document_positions(doc)), "doc_ids": cp_shard(state, doc)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under TP, a DTensor), left on the device."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---- forward and backward --------------------------------------------------------------------
def loss_sum(state: TrainState, inputs: torch.Tensor, targets: torch.Tensor, docs: dict | None = None) -> torch.Tensor:
    with _autocast(state):
        model = state.model
        logits = model(inputs, positions=state.cp_positions) if docs is None else model(inputs, **docs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def refresh_fp8_scales(state: TrainState) -> None:
    """Before the weights' first use since they changed (a step, a resume, a rollback): every fp8
    all-gather scale in one all-reduce, rather than one per weight inside the forward."""
    if state.fp8_scales is not None:
        state.fp8_scales(state.model_parts)


def forward_backward(state: TrainState, inputs: torch.Tensor, targets: torch.Tensor, micro: int,
                     docs: dict | None = None) -> torch.Tensor | float:
    """Runs all micro-batches of this rank's share; returns the summed (unnormalised) loss, on
    the device (a pipeline's schedule returns it read)."""
    refresh_fp8_scales(state)
    if state.pipeline is not None:
        # The schedule runs the micro-batches; its loss normalises exactly as below and the sum
        # comes back on the last stage only (0.0 elsewhere), so train_step counts it once.
        with _loss_context(state), _autocast(state):
            return state.pipeline.run(inputs.to(state.rt.device), targets.to(state.rt.device), micro)
    tokens_here = targets.numel()
    split = None if isinstance(micro, int) else micro  # uneven batch shares (layout/batch_shares.py)
    norm = tokens_here if split is None else tokens_here * split.norm_scale
    total = None  # summed on the device, never read here (step_values.py: read once per log interval)
    slices = split_micro(inputs.shape[0], micro) if split is None else split.slices()
    for i, (a, b) in enumerate(slices):
        # The ZeRO stage decides: reduce after every micro-batch (2, 3) or accumulate whole
        # gradients locally and reduce on the last (1, and plain replication).
        accumulation(state.model_parts, state.layout, i == len(slices) - 1)
        with _loss_context(state):
            mb_docs = None if docs is None else {k: _to_device(state, v[a:b]) for k, v in docs.items()}
            loss = loss_sum(state, _to_device(state, inputs[a:b]), _to_device(state, targets[a:b]), mb_docs)
            # Normalise by this rank's tokens for the whole step: summed over micro-batches and
            # averaged over data-parallel ranks by FSDP, this is the exact global mean.
            (loss / norm).backward()
        if i == 0 and state.noise is not None and len(slices) > 1:
            # Its gradient is (its tokens / the step's) times its own mean gradient: undo that.
            rescale = (tokens_here / targets[a:b].numel()) ** 2
            state.first_micro_sq = local_grad_sq(state.params, state.rt.world_size, state.rt.device) * rescale
        loss = loss.detach()
        total = loss if total is None else total + loss
    return 0.0 if total is None else _whole(total)


# ---- one optimizer step ----------------------------------------------------------------------
def start_noise_scale(state: TrainState) -> NoiseScale:
    """batch_ramp = "auto"'s estimator, from the checkpoint's EMAs on a resume; a layout that
    cannot read the first micro-batch's gradient is refused in one line."""
    why = unsupported(state.layout, state.diloco is not None)
    if why:
        raise ConfigError("train.batch_ramp", f"\"auto\" measures the gradient noise scale from the first "
                          f"micro-batch's gradient, which this layout ({state.layout.describe()}) does not have: {why}")
    return NoiseScale(state.progress.noise_ema)


def train_step(state: TrainState, batch, data_wait_s: float = 0.0) -> StepResult:
    """One optimizer step on `batch` (next_batch's; `data_wait_s`: what fetching it took, counted
    in the step's time). Advances state.progress; a non-finite step skips its update. Returns
    with its values unread (StepResult reads them when asked), its work possibly still queued."""
    cfg, rt, progress = state.cfg, state.rt, state.progress
    t0, cpu0 = time.perf_counter(), time.process_time()
    reset_peak_memory(rt.device)  # each step's row reports that step's peak
    gb = global_batch_at(cfg, progress.tokens_seen, progress.batch_points)  # `batch` is this rank's share of it
    # From the progress's EMAs whenever they differ from the estimator's: the first step, a resume,
    # and a rollback, which restores an earlier checkpoint's progress.
    if cfg.train.batch_ramp == "auto" and (state.noise is None or state.noise.state != (progress.noise_ema or [0.0, 0.0])):
        state.noise = start_noise_scale(state)
    state.first_micro_sq = None
    extend_schedule(cfg, progress)  # a no-op but after a resume (or rollback) onto another train.steps
    lr = (lr_at(progress.step, cfg.optimizer, cfg.train.steps, progress.lr_schedule["segment"])
          * batch_lr_scale(cfg.optimizer.batch_lr_rule, gb, cfg.train.global_batch))
    set_lr(state.optimizer, lr)
    if state.moe:
        # The MoE aux loss is a mean over sequences: each of this rank's sequences weighs 1/n
        # here, and FSDP's average over ranks completes the global mean (as for the token loss).
        set_aux_scale(state.moe, 1.0 / (batch.inputs.shape[0] if batch.split is None else batch.split.mean_rows))
    # Under cp, each rank normalises by its own tokens (forward_backward); FSDP averages over
    # dp x cp ranks, which makes that the global token mean.
    docs = doc_inputs(state, batch.inputs)
    # An uneven split (batch.split) takes micro_batch's place: its own micro-batches and normaliser.
    args = (state, cp_shard(state, batch.inputs), cp_shard(state, batch.targets),
            state.layout.mb if batch.split is None else batch.split)
    total_loss = forward_backward(*args) if docs is None else forward_backward(*args, docs)
    reduce_partial_grads(state.params)
    # tp ranks hold the same loss; count it once. cp ranks hold disjoint tokens: sum them.
    # Pipeline ranks without the last stage return 0.0, so each loss is still counted once.
    contributes = state.tp_rank == 0
    replicas = state.layout.dp_replicate if state.diloco else 1  # DiLoCo: each replica on its own
    ranks_per_stage = rt.world_size // replicas // state.layout.pp
    probe = state.first_micro_sq is not None
    sums = all_reduce_tensor(
        [total_loss if contributes else 0.0, local_grad_sq(state.params, ranks_per_stage, rt.device)]
        + ([state.first_micro_sq] if probe else []), rt.device, state.scalar_group)
    global_tokens = gb * cfg.data.seq_len
    result = StepResult(progress.step + 1, lr=lr, tokens=global_tokens, sample_ids=batch.global_ids)
    values = step_vector(sums, global_tokens // replicas, probe)
    # The aux-loss-free bias moves by the step's global load on the device, times its applied flag.
    reduce = (lambda t: torch.distributed.all_reduce(t, group=state.moe_group)) if state.moe_group else None
    moe = moe_statistics(state.moe, reduce, values[APPLIED]) if state.moe else None
    on_read = ([_noise_update(state, batch, gb)] if probe else []) + (
        [] if moe is None else [lambda r, row: r.extra.update(moe_metrics(state.moe, row[WIDTH:]))])
    result.defer(values if moe is None else torch.cat([values, moe.flatten().to(values)]), state.unread, on_read)
    # DiLoCo's replicas agree on the skip on the host, and an optimizer without a device-side
    # skip decides on it: both read the step's values now (a sync per step on a GPU).
    read_now = state.diloco is not None or not skips_on_device(state.optimizer)
    agreed = state.diloco.agree_start(result.skipped, rt.device) if state.diloco else None
    if state.before_update is not None:
        state.before_update()
    update(state, values, result, read_now)
    state.optimizer.zero_grad(set_to_none=True)
    result.extra.update({"data_wait_s": data_wait_s,
                         # CPU seconds this process spent on the step (all its threads): the work
                         # done, which a shared host's load stretches far less than the wall time.
                         "step_cpu_s": time.process_time() - cpu0, "global_batch": gb})
    progress.step += 1
    progress.tokens_seen += global_tokens
    if state.diloco:
        # Replicas skip their own non-finite steps; skip and rollback counts use "any replica".
        result.override_skipped(state.diloco.agree_finish(agreed))
        state.diloco.after_inner_step(progress.step, result.loss)
        result.extra["cross_replica_bytes"] = state.diloco.take_step_bytes()
        result.rows = state.diloco.take_rows()  # outer steps
    result.finished(time.perf_counter() - t0 + data_wait_s)
    return result


def step_vector(sums: torch.Tensor, tokens: int, probe: bool) -> torch.Tensor:
    """The step's report on the device (step_values.py's layout) from its all-reduced sums
    [loss sum, squared gradient norm(, first micro-batch's squared norm)]."""
    loss, grad_sq = sums[0] / tokens, sums[1]
    norm = grad_sq.sqrt()  # NaN for a negative sum
    applied = (torch.isfinite(loss) & torch.isfinite(norm)).to(torch.float64)  # the skip rule, on the device
    small = sums[2] if probe else torch.full((), float("nan"), dtype=torch.float64, device=sums.device)
    return torch.stack([loss, norm, applied, small, grad_sq])


def update(state: TrainState, values: torch.Tensor, result: StepResult, read_now: bool) -> None:
    """Clips the gradients and applies the optimizer's update unless the step is non-finite.
    Clipping scales by a factor computed on the device (like torch's clip_grad_norm_), so it
    reads nothing. The skip: fused AdamW takes torch's GradScaler door (`found_inf`, a device
    flag: its kernel leaves weights, moments and step counts alone), so the decision never
    reaches the host; with `read_now` (foreach and for-loop AdamW have no such door, DiLoCo
    agrees on the host) it is decided on the host from the step's values, read now."""
    if read_now and result.skipped:
        return
    grad_clip, optimizer = state.cfg.optimizer.grad_clip, state.optimizer
    if grad_clip > 0:
        scale_grads(state.params, clip_scale(values[GRAD_NORM], grad_clip))
    if read_now:
        optimizer.step()
        return
    step_unless(optimizer, (1.0 - values[APPLIED]).to(torch.float32))


def _noise_update(state: TrainState, batch, gb: int):
    """The gradient-noise-scale EMAs' update from the step's norms, run when the step is read
    (in step order, skipped steps left out); it sets the logging row's grad_noise_scale."""
    b_small = small_batch(state.layout, min(state.layout.mb, batch.inputs.shape[0]))

    def on_read(result: StepResult, row: list[float]) -> None:
        if result.skipped:
            return
        noise = state.noise.update(row[SMALL_SQ], b_small, row[GRAD_SQ], gb)
        state.progress.noise_ema = state.noise.state
        if noise is not None:
            result.extra["grad_noise_scale"] = noise

    return on_read


@torch.no_grad()
def validation_loss(state: TrainState) -> float:
    cfg = state.cfg
    if state.val_data is None:
        # A fixed set of validation samples (val_batches x val_batch_size) whatever the batch size
        # and the layout, so validation losses compare across runs; in batches of the training
        # shape, the last one padded with ignored rows.
        val_set = open_dataset(cfg.data.path, cfg.data.mix, "val")
        state.val_data = [(cp_shard(state, i), cp_shard(state, t), doc_inputs(state, i)) for i, t in validation_batches(
            val_set, cfg.data.seq_len, cfg.train.global_batch, cfg.train.val_batches * cfg.train.val_batch_size,
            state.dp_rank, state.dp_size)]
    for part in state.model_parts:
        part.eval()
    refresh_fp8_scales(state)
    device, micro, pipeline = state.rt.device, state.layout.mb, state.pipeline
    total, tokens = 0.0, 0  # total: summed in float64 on the device, read once by the all-reduce below
    for inputs, targets, docs in state.val_data:
        if pipeline is not None:  # forward-only schedule; the loss exists on the last stage
            with _loss_context(state), _autocast(state):
                total += pipeline.run(inputs.to(device), targets.to(device), micro, train=False)
            tokens += int((targets != IGNORE).sum()) if pipeline.has_last else 0
            continue
        for a, b in split_micro(inputs.shape[0], micro):
            with _loss_context(state):
                mb_docs = None if docs is None else {k: _to_device(state, v[a:b]) for k, v in docs.items()}
                loss = loss_sum(state, _to_device(state, inputs[a:b]), _to_device(state, targets[a:b]), mb_docs)
            total = total + _whole(loss).double()
            tokens += int((targets[a:b] != IGNORE).sum())
    for part in state.model_parts:
        part.train()
    if state.fsdp:
        reshard(state.model_parts)  # ZeRO-1/2 keep what a forward gathered; the step must not see it
    total, tokens = all_reduce_sum([total if state.tp_rank == 0 else 0.0,
                                    tokens if state.tp_rank == 0 else 0.0], device)
    return total / max(tokens, 1)


# ---- what a step reports ---------------------------------------------------------------------
@dataclass
class Peaks:
    """The run's peak FLOP/s (summed over ranks) that MFU divides by, and the model's FLOPs per
    token. fp8 runs report MFU against the bf16 peak (comparable with bf16 runs) and the fp8 peak."""

    total: float
    source: str
    fp8_total: float
    fp8_source: str
    flops_per_token: float
    fp8: bool
    raised: bool = False  # a step ran above the measured peak, which was raised to it (metrics.raise_peak)


def measure_peaks(state: TrainState) -> Peaks:
    low = state.autocast or state.layout.mp in ("bf16", "fp8")
    per_rank, source, fp8_peak, fp8_source = run_peaks(state.rt.device, torch.bfloat16 if low else torch.float32,
                                                       state.fp8)
    total, fp8_total = all_reduce_sum([per_rank, fp8_peak], state.rt.device)
    return Peaks(total, source, fp8_total, fp8_source, flops_per_token(state.cfg.model, state.cfg.data.seq_len),
                 state.fp8)


def metrics_row(r: StepResult, peaks: Peaks, tokens_seen: int, device) -> dict:
    """The step's row; a step above a measured peak raises it first (metrics.raise_peak), and the
    row that did so first carries the line saying so ("peak_raised")."""
    tps = r.tokens / r.seconds
    raised = raise_peak(peaks, peaks.flops_per_token * tps)
    return {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": tps,
            "mfu": mfu(peaks.flops_per_token * tps, peaks.total), "step_time_s": r.seconds,
            "tokens_seen": tokens_seen, "peak_memory_mb": peak_memory_mb(device), "skipped": r.skipped, **r.extra,
            **({"mfu_fp8": mfu(peaks.flops_per_token * tps, peaks.fp8_total)} if peaks.fp8 else {}),
            **({"peak_raised": raised} if raised else {})}


def close(state: TrainState) -> None:
    """Stops the loader's prefetch thread: the state trains no more."""
    state.loader.close()


# ---- a pipeline trace ------------------------------------------------------------------------
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
            {"step": state.progress.step, "schedule": lay.schedule, "p": lay.pp, "v": lay.v,
             "ranks": gathered}))
