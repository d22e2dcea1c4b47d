"""One optimizer step of a TrainState, and what surrounds it: the step's batch, what it returns,
validation. `train_step(state, batch) -> StepResult` branches on the layout only where a
dimension adds work: pipeline (pp > 1: the schedule runs the micro-batches), context parallel
(cp > 1: a share of each sequence), tensor parallel (tp > 1: the vocab-parallel loss), FSDP
(gradient sync per micro-batch) and fp8; and on the data for document masking.

The step reads no device value on the host: on a GPU each read (`float(t)`, `.item()`,
`.tolist()`, `if t`) waits for every kernel queued before it, the launch queue runs dry and the
next step's kernels start late. So its loss, gradient norm and whether its update was applied
stay in one small float64 vector on the device, which the step's StepResult holds. The first
time any of them is asked for, every step not yet read is read together, in one transfer
(`read_steps`), and each result settles in step order (the gradient-noise-scale EMAs update
then). The job loop asks on logging steps (and before a checkpoint or a rollback), so a run
reads the device once per `train.log_interval`, not once per step. Clipping and the non-finite
skip act on the device (optim.optimizer_step), as does the MoE bias update; the MoE routing
statistics ride in the same read (appended to the vector past WIDTH, handed to the step's
`on_read`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ndtrain.data.loader import IGNORE, validation_batches
from ndtrain.data.mixture import open_dataset
from ndtrain.data.packing import document_ids, document_positions
from ndtrain.errors import ConfigError
from ndtrain.model.moe import set_aux_scale, step_metrics as moe_metrics, step_statistics as moe_statistics
from ndtrain.parallel.data_parallel import accumulation, reshard
from ndtrain.parallel.grad_norm import all_reduce_sum, all_reduce_tensor, local_grad_sq, reduce_partial_grads
from ndtrain.train.metrics import reset_peak_memory
from ndtrain.train.noise_scale import NoiseScale, small_batch, unsupported
from ndtrain.train.optim import batch_lr_scale, extend_schedule, global_batch_at, lr_at, optimizer_step, set_lr
from ndtrain.train.state import TrainState


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
    if not state.layout.document_mask:
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
    total = None  # summed on the device, never read here (read_steps: once per log interval)
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
            state.layout.micro_batch if batch.split is None else batch.split)
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
    # DiLoCo's replicas agree on the skip on the host: they read the step's values now (a sync
    # per step on a GPU), as does an optimizer without a device-side skip (optimizer_step).
    agreed = state.diloco.agree_start(result.skipped, rt.device) if state.diloco else None
    if state.before_update is not None:
        state.before_update()
    optimizer_step(state.optimizer, state.params, cfg.optimizer.grad_clip, values[GRAD_NORM], values[APPLIED],
                   lambda: result.skipped, host_decides=state.diloco is not None)
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
    """The step's report on the device (StepResult's vector) from its all-reduced sums [loss sum,
    squared gradient norm(, first micro-batch's squared norm)]."""
    loss, grad_sq = sums[0] / tokens, sums[1]
    norm = grad_sq.sqrt()  # NaN for a negative sum
    applied = (torch.isfinite(loss) & torch.isfinite(norm)).to(torch.float64)  # the skip rule, on the device
    small = sums[2] if probe else torch.full((), float("nan"), dtype=torch.float64, device=sums.device)
    return torch.stack([loss, norm, applied, small, grad_sq])


def _noise_update(state: TrainState, batch, gb: int):
    """The gradient-noise-scale EMAs' update from the step's norms, run when the step is read
    (in step order, skipped steps left out); it sets the logging row's grad_noise_scale."""
    b_small = small_batch(state.layout, min(state.layout.micro_batch, batch.inputs.shape[0]))

    def on_read(result: StepResult, row: list[float]) -> None:
        if result.skipped:
            return
        noise = state.noise.update(row[SMALL_SQ], b_small, row[GRAD_SQ], gb)
        state.progress.noise_ema = state.noise.state
        if noise is not None:
            result.extra["grad_noise_scale"] = noise

    return on_read


# ---- what a step returns ---------------------------------------------------------------------
# The device vector's entries: the step's mean loss, its gradient norm, 1.0 when the update
# was applied (loss and norm finite) else 0.0, the first micro-batch's squared gradient norm
# (NaN when the noise scale is not measured) and the step's squared gradient norm.
# Entries past WIDTH: the step's own additions (MoE statistics), for its `on_read`.
LOSS, GRAD_NORM, APPLIED, SMALL_SQ, GRAD_SQ = range(5)
WIDTH = 5


class StepResult:
    """One step's report. `loss`, `grad_norm` and `skipped` are plain values, or, once `defer`
    hands it its device vector, read from the device the first time one is asked for."""

    def __init__(self, step: int, loss: float = math.nan, grad_norm: float = math.nan, lr: float = 0.0,
                 tokens: int = 0, seconds: float = 0.0, skipped: bool = False, extra: dict | None = None,
                 sample_ids: torch.Tensor | None = None, rows: list | None = None):
        self.step, self.lr, self.tokens, self.seconds = step, lr, tokens, seconds
        self.extra = {} if extra is None else extra
        self.sample_ids = sample_ids  # the global sample numbers this rank trained on
        self.rows = [] if rows is None else rows  # DiLoCo's outer-step rows, for metrics.jsonl
        self._values = (loss, grad_norm, skipped)
        self._device: torch.Tensor | None = None
        self._queue: list | None = None
        self._on_read: list[Callable] = []
        self._ended = 0.0  # perf_counter when the step returned (its device work may still run)

    def defer(self, values: torch.Tensor, queue: list, on_read: list[Callable] = ()) -> StepResult:
        """Holds `values` (the WIDTH-vector above and any additions, on the device) unread in
        `queue` (the state's, in step order); each `on_read(result, row)` runs when it is read,
        before any later step's."""
        self._device, self._queue, self._on_read = values, queue, list(on_read)
        queue.append(self)
        return self

    @property
    def unread(self) -> bool:
        return self._device is not None

    def finished(self, seconds: float) -> None:
        """The step's host time; a later read adds its share of the wait for the device."""
        self.seconds, self._ended = seconds, time.perf_counter()

    def override_skipped(self, skipped: bool) -> None:
        """DiLoCo: a step counts as skipped when any replica skipped it (read by then)."""
        self._values = (*self._values[:2], skipped)

    def _settle(self, row: list[float]) -> None:
        self._device = self._queue = None
        self._values = (row[LOSS], row[GRAD_NORM], row[APPLIED] == 0.0)
        on_read, self._on_read = self._on_read, []
        for callback in on_read:
            callback(self, row)

    def _get(self, i: int):
        if self._device is not None:
            read_steps(self._queue)
        return self._values[i]

    @property
    def loss(self) -> float:
        return self._get(0)

    @property
    def grad_norm(self) -> float:
        return self._get(1)

    @property
    def skipped(self) -> bool:
        return self._get(2)


def read_steps(queue: list) -> None:
    """Reads every unread step of `queue` in one device-to-host transfer and settles them in order."""
    if not queue:
        return
    pending = list(queue)
    queue.clear()
    device = pending[-1]._device.device
    vectors = [r._device for r in pending]
    flat = torch.cat(vectors).tolist()  # the one read (a step's vector may be longer: MoE)
    rows, at = [], 0
    for v in vectors:
        rows.append(flat[at:at + v.numel()])
        at += v.numel()
    # On an asynchronous device (not the CPU) unread steps returned when their work was queued,
    # not done: the read waited for the rest. Each gets an equal share, so the interval's step
    # times add up to its wall time.
    ended, wait = pending[-1]._ended, 0.0
    if ended and device.type != "cpu":
        wait = max(0.0, time.perf_counter() - ended) / len(pending)
    for result, row in zip(pending, rows):
        result.seconds += wait
        result._settle(row)


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
    device, micro, pipeline = state.rt.device, state.layout.micro_batch, state.pipeline
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


# ---- after the last step ---------------------------------------------------------------------
def close(state: TrainState) -> None:
    """Stops the loader's prefetch thread: the state trains no more."""
    state.loader.close()
