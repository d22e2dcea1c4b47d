"""The Trainer: one optimizer step, validation, and the state objects a checkpoint is made of
(Trainer.checkpointer); the job loop around it is job.py. One code path for every layout: a
single process is the layout whose degrees are all 1 (a mesh with no dimension, no process
group). It branches on the layout only where a dimension adds work: pipeline (pp > 1: the
schedule runs the micro-batches), context parallel (cp > 1: a share of each sequence), tensor
parallel (tp > 1: the vocab-parallel loss), FSDP (gradient sync per micro-batch) and fp8; on the
data for document masking; and, in `train`, on the launcher (ranks of a plain torchrun agree on
one run directory). Step and tokens seen live in `self.progress` (a TrainProgress that the
checkpointer saves and restores); `step` and `tokens_seen` read it."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from ndtrain.compat.torch import torch_logger
from ndtrain.config import JobConfig, global_batch_at, to_dict
from ndtrain.data.loader import IGNORE, StatefulLoader, validation_batches
from ndtrain.data.mixture import make_loader, open_dataset
from ndtrain.data.packing import document_ids, document_positions
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.layout.flops import flops_per_token
from ndtrain.model.init import canonical_name, materialize
from ndtrain.model.moe import end_step as moe_end_step, moe_layers, set_aux_scale
from ndtrain.model.llama import build_model, set_cpu_bf16_attention
from ndtrain.parallel import dims as pdims
from ndtrain.parallel.compose import parallelize
from ndtrain.parallel.data_parallel import accumulation, reshard
from ndtrain.parallel.grad_norm import (all_reduce_sum, clip_coefficient, local_grad_sq, reduce_partial_grads,
                                        scale_grads)
from ndtrain.train import distributed, job
from ndtrain.train.checkpoint import DiLoCoState, ModelState, OptimizerState, RNGState, TrainProgress
from ndtrain.train.distributed import env_world_size
from ndtrain.train.metrics import MetricsLogger, mfu, peak_memory_mb, reset_peak_memory, run_peaks
from ndtrain.train.plan import Plan, as_written, resolve_plan
from ndtrain.train.trackers import check_installed as check_trackers
from ndtrain.train.optim import build_optimizer, lr_at, set_lr


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    skipped: bool = False
    extra: dict = field(default_factory=dict)


def split_micro(n: int, micro: int) -> list[tuple[int, int]]:
    """[start, end) slices of at most `micro` rows. Loss is normalised by tokens, so an uneven
    last micro-batch (after an elastic shrink) is still exact."""
    return [(s, min(s + micro, n)) for s in range(0, n, micro)]


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path | None = None, log: bool = True, plan: Plan | None = None):
        """`plan`: the job resolved for this world (train/plan.py: resolve_plan, as train() and
        `ndtrain train` resolve it); its config is what trains. None: the config as written,
        no planner (as_written)."""
        self.rt = distributed.setup(cfg.train)
        self.plan = plan if plan is not None else as_written(cfg, self.rt.world_size)
        if self.plan.world != self.rt.world_size:
            raise NdtrainError(f"the plan was resolved for {self.plan.world} ranks but this run has "
                               f"{self.rt.world_size}; resolve it for this world")
        cfg = self.cfg = self.plan.config
        self.dims = self.plan.layout  # checked by the layout's rules, batch rule included, for this world
        self.mesh = pdims.build_mesh(self.dims, self.rt.device.type)  # one process: a mesh with no dimension
        self.run_dir = run_dir
        torch.manual_seed(cfg.train.seed)

        self.train_set = open_dataset(cfg.data.path, cfg.data.mix, "train")
        if self.train_set.vocab_size > cfg.model.vocab_size:
            raise NdtrainError(f"the data's tokenizer has {self.train_set.vocab_size} tokens but "
                               f"model.vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")
        if cfg.data.document_mask and self.train_set.eos_id is None:
            raise ConfigError("data.document_mask", f"{cfg.data.path} marks no document ends (a format-1 corpus); "
                                                    "prepare it again with this ndtrain")
        self.dp_rank, self.dp_size = self._dp_coords()
        self.loader: StatefulLoader = make_loader(self.train_set, cfg.data.seq_len, cfg.train.seed, self.dp_rank,
                                                  self.dp_size)
        # The next batches are built on a thread while this step computes (pinned for a GPU copy).
        self.loader.start_prefetch(cfg.data.prefetch, pin_memory=self.rt.device.type == "cuda")

        # Context parallel: this rank holds a load-balanced share of each sequence, and the model
        # (every pipeline stage too) needs those tokens' global positions for RoPE (None = 0..s-1,
        # the whole sequence).
        self.cp_rank = self.mesh.coordinate("cp")[0]
        self.cp_positions = None
        if self.dims.cp > 1:
            from ndtrain.parallel.context import cp_positions

            self.cp_positions = cp_positions(cfg.data.seq_len, self.dims.cp, self.cp_rank, self.rt.device)

        # A pipeline rank builds only its own stage(s), several with virtual stages; every other
        # layout sees one part, the whole model.
        self.pipeline = None
        if self.dims.pp > 1:
            from ndtrain.parallel.pipeline import build_pipeline

            self.pipeline = build_pipeline(cfg, self.dims, self.mesh, self.rt.device, self.cp_positions)
            self.model_parts = self.pipeline.parts
            self.model = self.model_parts[0]
        else:
            self.model = build_model(cfg.model, "meta")
            self.model = parallelize(self.model, self.dims, self.mesh)
            materialize(self.model, cfg.train.seed, self.rt.device)
            self.model_parts = [self.model]
        if self.plan.host is not None:  # the host probe's bf16 CPU attention kernel (plan_choices.host_choice)
            for part in self.model_parts:
                set_cpu_bf16_attention(part, self.plan.host.bf16_attention)
        self.fsdp = isinstance(self.model, FSDPModule)  # plain replication has torch's DDP instead
        self.params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        # MoE routing statistics are summed over the ranks that saw different tokens (dp x cp).
        self.moe = moe_layers(self.model_parts)
        self.moe_group = self.mesh["dp_cp"].get_group() if self.moe else None  # None: one such rank
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer)
        # DiLoCo (parallel/diloco.py): replicas train apart and sync every H steps; per-step
        # scalars then reduce inside the replica only (None: over the world).
        self.diloco = None
        if self.dims.sync == "diloco" and self.mesh is not None:
            from ndtrain.parallel.diloco import DiLoCo

            self.diloco = DiLoCo(cfg.parallel, self.mesh, self.dims, self.model_parts, cfg.train.steps,
                                 cfg.model.n_layers)
        self.scalar_group = self.diloco.replica_group if self.diloco else None
        # bf16 (and fp8, which is bf16 outside its fp8 matmuls) without FSDP (one process, or TP
        # alone) runs under autocast instead of FSDP's policy.
        self.fp8 = cfg.parallel.mixed_precision == "fp8"
        low = cfg.parallel.mixed_precision in ("bf16", "fp8")
        self.autocast = (low and not self.fsdp) or cfg.train.autocast_bf16
        self.fp8_scales = None  # FSDP float8 all-gather: the weights' fp8 scales, refreshed per forward
        if self.fp8 and self.fsdp:
            from ndtrain.parallel.float8 import float8_all_gather, precompute_scales

            self.fp8_scales = precompute_scales if float8_all_gather(self.dims) else None
        self.tp_rank = self.mesh.coordinate("tp")[0]

        self.progress = TrainProgress()  # step, tokens seen, skip windows: saved by the checkpointer
        # Set by checkpointer(): an async save may still be copying the state, and the optimizer
        # must not write the weights until it is done (the copy overlaps forward and backward).
        self.before_update = None
        dtype = torch.bfloat16 if low or self.autocast else torch.float32
        # fp8 runs report MFU against the bf16 peak (comparable with bf16 runs) and the fp8 peak.
        self.peak_flops_per_rank, self.peak_source, fp8_peak, self.peak_fp8_source = run_peaks(
            self.rt.device, dtype, self.fp8)
        self.peak_flops_total, self.peak_fp8_total = all_reduce_sum([self.peak_flops_per_rank, fp8_peak],
                                                                    self.rt.device)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        if log and run_dir is not None:  # on every rank: a missing package stops all of them, none waits
            check_trackers(cfg.logging)
        self.logger = MetricsLogger(run_dir, log and self.rt.is_main and run_dir is not None, cfg.train.steps,
                                    cfg.logging.progress, cfg.logging, to_dict(cfg))
        self.val_data = None

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def tokens_seen(self) -> int:
        return self.progress.tokens_seen

    def checkpointer(self, run_dir: Path | None, cfg: JobConfig | None = None):
        """A Checkpointer of this trainer's state objects (`cfg`: other checkpoint settings)."""
        from ndtrain.train.checkpoint import Checkpointer, data_fingerprint

        model = ModelState(self.model_parts, fp8=self.fp8)
        states = {"model": model, "optim": OptimizerState(model, self.optimizer), "progress": self.progress,
                  "loader": self.loader, "rng": RNGState()}
        if self.diloco:
            states["diloco"] = DiLoCoState(self.diloco)
        ckpt = Checkpointer(cfg or self.cfg, run_dir, states, runtime=self.rt, data=data_fingerprint(
            self.train_set.manifest), layout=self.dims.describe(), dp_size=self.dp_size, info=self.logger.info,
            record=self.logger.log)
        self.before_update = ckpt.wait_for_staging
        return ckpt

    # ---- layout helpers -------------------------------------------------------------------
    def _dp_coords(self) -> tuple[int, int]:
        return self.mesh.coordinate("dp")

    def _loss_context(self):
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _autocast(self):
        if self.autocast:
            return torch.autocast(self.rt.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor, docs: dict | None = None) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs, positions=self.cp_positions) if docs is None else self.model(inputs, **docs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")

    def _doc_inputs(self, inputs: torch.Tensor) -> dict | None:
        """Document ids and per-document positions of full [batch, seq] inputs, cp-sharded like
        the tokens (None without document masking)."""
        if not self.cfg.data.document_mask:
            return None
        doc = document_ids(inputs, self.train_set.eos_id)
        return {"positions": self._cp_shard(document_positions(doc)), "doc_ids": self._cp_shard(doc)}

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.rt.device, non_blocking=True)  # from pinned memory on a GPU: an async copy

    def _cp_shard(self, t: torch.Tensor) -> torch.Tensor:
        """This cp rank's tokens of [batch, seq] inputs or targets."""
        if self.dims.cp == 1:
            return t
        from ndtrain.parallel.context import shard_sequence

        return shard_sequence(t, self.dims.cp, self.cp_rank)

    @staticmethod
    def _value(t: torch.Tensor) -> float:
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        return float(t.detach())

    # ---- one optimizer step ---------------------------------------------------------------
    def _refresh_fp8_scales(self) -> None:
        """Before the weights' first use since they changed (a step, a resume, a rollback): every
        fp8 all-gather scale in one all-reduce, rather than one per weight inside the forward."""
        if self.fp8_scales is not None:
            self.fp8_scales(self.model_parts)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, micro: int, docs: dict | None = None) -> float:
        """Runs all micro-batches of this rank's share; returns the summed (unnormalised) loss."""
        self._refresh_fp8_scales()
        if self.pipeline is not None:
            # The schedule runs the micro-batches; its loss normalises exactly as below and the
            # sum comes back on the last stage only (0.0 elsewhere), so train_step counts it once.
            with self._loss_context(), self._autocast():
                return self.pipeline.run(inputs.to(self.rt.device), targets.to(self.rt.device), micro)
        tokens_here = targets.numel()
        total = None  # summed on the device; read once per step (a read per micro-batch syncs the host)
        slices = split_micro(inputs.shape[0], micro)
        for i, (a, b) in enumerate(slices):
            # The ZeRO stage decides: reduce after every micro-batch (2, 3) or accumulate whole
            # gradients locally and reduce on the last (1, and plain replication).
            accumulation(self.model_parts, self.dims, i == len(slices) - 1)
            with self._loss_context():
                mb_docs = None if docs is None else {k: self._to_device(v[a:b]) for k, v in docs.items()}
                loss = self._loss_sum(self._to_device(inputs[a:b]), self._to_device(targets[a:b]), mb_docs)
                # Normalise by this rank's tokens for the whole step: summed over micro-batches
                # and averaged over data-parallel ranks by FSDP, this is the exact global mean.
                (loss / tokens_here).backward()
            loss = loss.detach()
            total = loss if total is None else total + loss
        return self._value(total) if total is not None else 0.0

    def train_step(self) -> StepResult:
        cfg = self.cfg
        t0, cpu0 = time.perf_counter(), time.process_time()
        reset_peak_memory(self.rt.device)  # each step's row reports that step's peak
        # One of the batches the plan's layout check split over dp (the batch rule, layout/rules.py)
        gb = global_batch_at(cfg, self.tokens_seen)
        t_data = time.perf_counter()
        batch = self.loader.next_batch(gb)
        self.last_sample_ids = batch.global_ids  # what this rank trains on (the exactly-once checks)
        data_wait = time.perf_counter() - t_data  # ~0 when prefetching keeps ahead of the step
        lr = lr_at(self.step, cfg.optimizer, cfg.train.steps)
        set_lr(self.optimizer, lr)
        # The MoE aux loss is a mean over sequences: each of this rank's sequences weighs 1/n here,
        # and FSDP's average over ranks completes the global mean (as for the token loss).
        set_aux_scale(self.moe, 1.0 / batch.inputs.shape[0])
        # Under cp, each rank normalises by its own tokens (forward_backward); FSDP averages
        # over dp x cp ranks, which makes that the global token mean.
        docs = self._doc_inputs(batch.inputs)
        args = (self._cp_shard(batch.inputs), self._cp_shard(batch.targets), cfg.train.micro_batch)
        loss_sum = self.forward_backward(*args) if docs is None else self.forward_backward(*args, docs)
        reduce_partial_grads(self.params)
        # tp ranks hold the same loss; count it once. cp ranks hold disjoint tokens: sum them.
        # Pipeline ranks without the last stage return 0.0, so each loss is still counted once.
        contributes = self.tp_rank == 0
        replicas = self.dims.dp_replicate if self.diloco else 1  # DiLoCo: each replica on its own
        ranks_per_stage = self.rt.world_size // replicas // self.dims.pp
        loss_total, grad_sq = all_reduce_sum(
            [loss_sum if contributes else 0.0, float(local_grad_sq(self.params, ranks_per_stage))], self.rt.device,
            self.scalar_group)
        global_tokens = gb * cfg.data.seq_len
        loss = loss_total / (global_tokens // replicas)
        grad_norm = math.sqrt(grad_sq) if grad_sq >= 0 else float("nan")
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        agreed = self.diloco.agree_start(skipped, self.rt.device) if self.diloco else None
        if self.before_update is not None:
            self.before_update()
        if not skipped:
            coef = clip_coefficient(grad_norm, cfg.optimizer.grad_clip)
            if coef < 1.0:
                scale_grads(self.params, coef)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # After the step, from the step's global load: aux-loss-free bias update and MoE metrics.
        reduce = (lambda t: torch.distributed.all_reduce(t, group=self.moe_group)) if self.moe_group else None
        extra = {**moe_end_step(self.moe, reduce, update_bias=not skipped), "data_wait_s": data_wait,
                 # CPU seconds this process spent on the step (all its threads): the work done,
                 # which a shared host's load stretches far less than the wall time.
                 "step_cpu_s": time.process_time() - cpu0}
        self.progress.step += 1
        self.progress.tokens_seen += global_tokens
        if self.diloco:
            # Replicas skip their own non-finite steps; skip and rollback counts use "any replica".
            skipped = self.diloco.agree_finish(agreed)
            self.diloco.after_inner_step(self.step, loss)
            extra["cross_replica_bytes"] = self.diloco.take_step_bytes()
        return StepResult(self.step, loss, grad_norm, lr, global_tokens, time.perf_counter() - t0, skipped, extra)

    @torch.no_grad()
    def validate(self) -> float:
        cfg = self.cfg
        if self.val_data is None:
            # A fixed set of validation samples (val_batches x val_batch_size) whatever the batch
            # size and the layout, so validation losses compare across runs; in batches of the
            # training shape, the last one padded with ignored rows.
            val_set = open_dataset(cfg.data.path, cfg.data.mix, "val")
            self.val_data = [(self._cp_shard(i), self._cp_shard(t), self._doc_inputs(i)) for i, t in validation_batches(
                val_set, cfg.data.seq_len, cfg.train.global_batch, cfg.train.val_batches * cfg.train.val_batch_size,
                self.dp_rank, self.dp_size)]
        for part in self.model_parts:
            part.eval()
        self._refresh_fp8_scales()
        total, tokens = 0.0, 0
        for inputs, targets, docs in self.val_data:
            if self.pipeline is not None:  # forward-only schedule; the loss exists on the last stage
                with self._loss_context(), self._autocast():
                    total += self.pipeline.run(inputs.to(self.rt.device), targets.to(self.rt.device),
                                               cfg.train.micro_batch, train=False)
                tokens += int((targets != IGNORE).sum()) if self.pipeline.has_last else 0
                continue
            for a, b in split_micro(inputs.shape[0], cfg.train.micro_batch):
                with self._loss_context():
                    mb_docs = None if docs is None else {k: self._to_device(v[a:b]) for k, v in docs.items()}
                    loss = self._loss_sum(self._to_device(inputs[a:b]), self._to_device(targets[a:b]), mb_docs)
                total += self._value(loss)
                tokens += int((targets[a:b] != IGNORE).sum())
        for part in self.model_parts:
            part.train()
        if self.fsdp:
            reshard(self.model_parts)  # ZeRO-1/2 keep what a forward gathered; the step must not see it
        total, tokens = all_reduce_sum([total if self.tp_rank == 0 else 0.0,
                                        tokens if self.tp_rank == 0 else 0.0], self.rt.device)
        return total / max(tokens, 1)

    def metrics_row(self, r: StepResult) -> dict:
        tps = r.tokens / r.seconds
        return {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": tps,
                "mfu": mfu(self.flops_per_token * tps, self.peak_flops_total), "step_time_s": r.seconds,
                "tokens_seen": self.tokens_seen, "peak_memory_mb": peak_memory_mb(self.rt.device),
                "skipped": r.skipped, **r.extra,
                **({"mfu_fp8": mfu(self.flops_per_token * tps, self.peak_fp8_total)} if self.fp8 else {})}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 copies of this rank's parameters (a collective under FSDP/TP)."""
        # Gathering FSDP x TP (strided) shards warns about sequential all-gathers; that is expected.
        torch_logger("redistribute_logger").setLevel(logging.ERROR)  # a private torch module's: compat.torch
        out = {}
        for part in self.model_parts:
            for name, t in part.state_dict().items():
                if hasattr(t, "full_tensor"):
                    t = t.full_tensor()
                out[canonical_name(name)] = t.detach().float().cpu().clone()
        return out

    def save_pipeline_trace(self, run_dir: Path) -> None:
        """Every rank's timed F/B/W actions of the step just traced, gathered into rank 0's
        `pipeline_trace.json` (the input of `ndtrain report`'s Gantt chart)."""
        trace = {"rank": self.rt.rank, "stages": [s.stage_index for s in self.pipeline.stages],
                 "traces": self.pipeline.traces[-1:]}
        self.pipeline.trace, self.pipeline.traces = False, []
        gathered = [None] * self.rt.world_size
        torch.distributed.all_gather_object(gathered, trace)
        if self.rt.is_main:
            from ndtrain.train.run_files import write_run_file

            p = self.cfg.parallel
            write_run_file(run_dir / "pipeline_trace.json", json.dumps(
                {"step": self.step, "schedule": p.pp_schedule, "p": self.dims.pp, "v": p.pp_virtual_stages,
                 "ranks": gathered}))

    def close(self) -> None:
        self.loader.close()
        self.logger.close()


def default_run_dir(cfg: JobConfig) -> Path:
    if cfg.train.output_dir:
        return Path(cfg.train.output_dir)
    return Path("runs") / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def train(cfg: JobConfig, plan: Plan | None = None) -> dict:
    """Run a whole job: train, validate, checkpoint, sample. Returns a summary (rank 0's view).
    `plan`: the job resolved for this world; by default resolved here, as `ndtrain train` resolves
    it (train/plan.py), so the Python API and the command build the same run. `cfg` is not changed:
    the run trains with the plan's config."""
    from ndtrain.train import recovery

    plan = plan if plan is not None else resolve_plan(cfg, env_world_size())
    cfg = plan.config

    # Under torchrun the run id is stable across restarts, so a restarted group finds its checkpoints.
    run_dir = recovery.launcher_run_dir(cfg) or default_run_dir(cfg)
    if env_world_size() > 1 and not cfg.train.output_dir:
        # Ranks started by plain torchrun would each pick their own timestamp: agree on rank 0's.
        distributed.setup(cfg.train)
        holder = [str(run_dir)]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_dir = Path(holder[0])
    from ndtrain.train.rundir import claim_for_group

    lock = claim_for_group(cfg, run_dir)
    try:
        return job.run(plan, run_dir, lambda: Trainer(cfg, run_dir, plan=plan))
    finally:
        if lock is not None:
            lock.release()
