"""Pipeline parallel: split the decoder into stages, build only this rank's stages, and run a
torch.distributed.pipelining schedule over them with the trainer's exact loss normalisation.

A stage is the ordinary `Transformer` with the parts it does not own deleted (layers dropped from
the ModuleDict, embedding/norm/head set to None), so every parameter keeps its canonical name:
layout-independent init fills it, and checkpoints reshard between pipeline and other layouts.
Each stage goes through the same `parallelize` (TP, AC, compile, FSDP) as a whole model, on the
sub-meshes of this rank's pipeline coordinate.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndtrain.errors import NdtrainError
from ndtrain.model.config import ModelConfig, layer_params
from ndtrain.parallel import pipeline_schedule as ps

SPLITS = ("balanced", "uniform", "llama3")


# ---- splitting layers into stages ----------------------------------------------------------

def part_costs(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(per-layer cost, embedding cost, norm+head cost). A part's cost is its share of the
    model's training FLOPs plus its share of the parameters: FLOPs set the stage's time, and
    parameters (weights, gradients, optimizer state) its memory, and a stage must fit both."""
    attn = 12 * cfg.n_heads * cfg.head_dim * seq_len
    layer_flops = [6 * (layer_params(cfg, i, active_only=True) - 2 * cfg.dim) + attn for i in range(cfg.n_layers)]
    layer_par = [layer_params(cfg, i) for i in range(cfg.n_layers)]
    head_flops = 6 * cfg.vocab_size * cfg.dim
    embed_par, head_par = cfg.vocab_size * cfg.dim, cfg.vocab_size * cfg.dim + cfg.dim
    total_flops = sum(layer_flops) + head_flops
    total_par = sum(layer_par) + embed_par + head_par
    layers = [f / total_flops + p / total_par for f, p in zip(layer_flops, layer_par)]
    return layers, embed_par / total_par, head_flops / total_flops + head_par / total_par


def _balanced(costs: list[float], n: int, first: float, last: float) -> list[int]:
    """Contiguous split of `costs` into n non-empty stages minimising the costliest stage (the
    pipeline runs at the pace of its slowest stage); ties go to the evenest split."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[k][j]: (max cost, sum of squares) splitting the first j layers into k+1 stages.
    best = [[inf] * (L + 1) for _ in range(n)]
    cut = [[0] * (L + 1) for _ in range(n)]
    for j in range(1, L + 1):
        c = prefix[j] + first + (last if n == 1 else 0.0)
        best[0][j] = (c, c * c)
    for k in range(1, n):
        extra = last if k == n - 1 else 0.0
        for j in range(k + 1, L + 1):
            for i in range(k, j):
                prev = best[k - 1][i]
                c = prefix[j] - prefix[i] + extra
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    counts, j = [], L
    for k in range(n - 1, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def stage_layer_counts(cfg: ModelConfig, n_stages: int, seq_len: int, mode: str = "balanced",
                       explicit: list[int] | None = None) -> list[int]:
    """Layers per stage: explicit `layers_per_stage`, else by `mode`:
    balanced (FLOPs + parameters, embedding and head included), uniform (layer count only), or
    llama3 (even, with one layer fewer on the first and last stage, as Llama 3 405B was trained)."""
    L = cfg.n_layers
    if explicit:
        if len(explicit) != n_stages or sum(explicit) != L or min(explicit) < 1:
            raise NdtrainError(f"layers_per_stage {explicit} must be {n_stages} positive counts summing to {L}")
        return list(explicit)
    if n_stages > L:
        raise NdtrainError(f"{n_stages} pipeline stages but only {L} layers")
    if mode == "balanced":
        costs, first, last = part_costs(cfg, seq_len)
        return _balanced(costs, n_stages, first, last)
    if mode in ("uniform", "llama3"):
        total = L + (2 if mode == "llama3" and n_stages > 1 else 0)
        base, extra = divmod(total, n_stages)
        counts = [base] * n_stages
        middle = list(range(1, n_stages - 1)) or list(range(n_stages))
        for k in range(extra):  # the remainder goes to the middle stages, away from embedding and head
            counts[middle[k % len(middle)]] += 1
        if total != L:
            counts[0] -= 1
            counts[-1] -= 1
        if min(counts) < 1:
            raise NdtrainError(f"the {mode} split of {L} layers over {n_stages} stages leaves a stage empty")
        return counts
    raise NdtrainError(f"unknown pipeline split {mode!r} (choose from {', '.join(SPLITS)})")


def stage_layers(counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def build_stage_module(cfg: ModelConfig, layers: list[int], first: bool, last: bool) -> nn.Module:
    """The whole model on meta, pruned to one stage (no memory is allocated for the rest)."""
    from ndtrain.model.llama import build_model

    model = build_model(cfg, "meta")
    keep = {str(i) for i in layers}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def merged_view(parts: list[nn.Module]) -> nn.Module:
    """One module over several stages of this rank, with the canonical names (no 'part.N.'
    prefix), for state dicts and one optimizer over every part. It owns nothing of its own."""
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    view.layers = nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():
            if name == "layers":
                for key, block in child.items():
                    view.layers[key] = block
            elif child is not None:
                setattr(view, name, child)
    return view


# ---- running a schedule --------------------------------------------------------------------

class Pipeline:
    """This rank's stages and the schedule over them. `run` is one optimizer step's forward and
    backward (or forward only), returning the summed token loss where the last stage lives."""

    def __init__(self, stages, schedule: str, p: int, v: int, pp_microbatches: int, positions: torch.Tensor):
        self.stages = stages
        self.parts = [s.submod for s in stages]
        self.schedule_name, self.p, self.v = schedule, p, v
        self.pp_microbatches = pp_microbatches
        self.num_stages = stages[0].num_stages
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self._positions = positions
        self._schedules: dict[int, object] = {}
        self._loss_sums: list[torch.Tensor] = []
        self._tokens = 1
        # Timeline recording for `ndtrain pipeline-report`: off while training normally.
        self.trace = False
        self.traces: list[dict] = []
        self._events: list[tuple] | None = None
        self._t0 = 0.0
        for part in self.parts:
            part.register_forward_pre_hook(self._add_positions, with_kwargs=True)
        for stage in stages:
            self._instrument(stage)

    def _add_positions(self, module, args, kwargs):
        # A later stage receives hidden states, sequence-sharded under SP: the model cannot infer
        # the token positions from them, so every stage is handed the true ones.
        if len(args) < 2 and kwargs.get("positions") is None:
            kwargs = {**kwargs, "positions": self._positions}
        return args, kwargs

    def microbatches(self, rows: int, micro_batch: int) -> int:
        m = ps.microbatch_count(self.pp_microbatches, rows, micro_batch)
        if rows % m:
            raise NdtrainError(f"this rank's {rows} sequences do not split into {m} equal pipeline micro-batches")
        return m

    def _schedule(self, m: int):
        if m not in self._schedules:
            from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

            problem = ps.microbatch_problem(self.schedule_name, self.p, self.v, m)
            if problem:
                raise NdtrainError(f"parallel.pp_schedule: {problem}")
            cls = get_schedule_class(self.schedule_name)
            target = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
            # scale_grads=False: the loss is already normalised by this rank's tokens.
            self._schedules[m] = cls(target, m, loss_fn=self._loss_fn, scale_grads=False)
        return self._schedules[m]

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t, cpu = time.perf_counter(), time.thread_time()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        self._loss_sums.append(loss.detach())
        if self._events is not None:  # the loss is last-stage compute, drawn with its forward
            self._events.append((self.num_stages - 1, "F", -1, t - self._t0, time.perf_counter() - self._t0,
                                 time.thread_time() - cpu))
        # Divided by the tokens of this rank's whole step, as without a pipeline: summed over
        # micro-batches and averaged over data-parallel ranks this is the global token mean.
        return loss / self._tokens

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int, train: bool = True) -> float:
        m = self.microbatches(inputs.shape[0], micro_batch)
        sched = self._schedule(m)
        self._tokens = targets.numel()
        self._loss_sums.clear()
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets} if self.has_last else {}
        tracing = self.trace and train
        if tracing:
            dist.barrier()  # a common origin for every rank's timeline
            self._events, self._t0 = [], time.perf_counter()
        try:
            if train:
                sched.step(*args, return_outputs=False, **kwargs)
            elif self.schedule_name in ps.V_SHAPED:
                # torch 2.13's forward-only run of a V schedule asks the same-rank neighbour stage
                # for input gradients it never computed; run a full step and drop its gradients.
                with torch.enable_grad():
                    sched.step(*args, return_outputs=False, **kwargs)
                for part in self.parts:
                    part.zero_grad(set_to_none=True)
            else:
                sched.eval(*args, return_outputs=False, **kwargs)
        finally:
            if tracing:
                self.traces.append({"m": m, "end": time.perf_counter() - self._t0, "events": self._events})
                self._events = None
        if not self.has_last:
            return 0.0
        # Metadata inference on a schedule's first step calls the loss once more: keep the last m.
        return float(sum(_value(t) for t in self._loss_sums[-m:]))

    def _instrument(self, stage) -> None:
        fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        idx = stage.stage_index

        def record(kind: str, mb: int, t: float, cpu: float) -> None:
            # Wall-clock start/end plus the thread's CPU time: on a host with fewer cores than
            # ranks, wall minus CPU is the time the action waited for a core.
            if self._events is not None:
                self._events.append((idx, kind, mb, t - self._t0, time.perf_counter() - self._t0,
                                     time.thread_time() - cpu))

        def forward_one_chunk(chunk, *args, **kwargs):
            t, cpu = time.perf_counter(), time.thread_time()
            out = fwd(chunk, *args, **kwargs)
            record("F", chunk, t, cpu)
            return out

        def backward_one_chunk(chunk, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            t, cpu = time.perf_counter(), time.thread_time()
            out = bwd(chunk, *args, **kwargs)
            record("B" if full else "I", chunk, t, cpu)
            return out

        def backward_weight_one_chunk(chunk, *args, **kwargs):
            t, cpu = time.perf_counter(), time.thread_time()
            out = wgt(chunk, *args, **kwargs)
            record("W", chunk, t, cpu)
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

        # On a schedule's first step torch infers shapes by running each stage once more (on the
        # first micro-batch, or on uninitialised tensors). That forward is not training: run it
        # in eval mode so it stays out of per-step statistics (MoE routing loads, which drive the
        # aux-loss-free bias update).
        infer = stage._compute_outputs

        def compute_outputs(*args, module, **kwargs):
            was_training = module.training
            module.train(False)
            try:
                return infer(*args, module=module, **kwargs)
            finally:
                module.train(was_training)

        stage._compute_outputs = compute_outputs


def _value(t: torch.Tensor) -> float:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def build_pipeline(cfg, dims, mesh, device: torch.device) -> Pipeline:
    """Build, parallelise and materialise only this rank's stages; wrap them in a Pipeline."""
    from torch.distributed.pipelining import PipelineStage

    from ndtrain.model.init import materialize
    from ndtrain.parallel.compose import parallelize

    par = cfg.parallel
    p, v = dims.pp, par.pp_virtual_stages
    stage_par = par
    if par.pp_schedule in ps.SPLIT_BACKWARD and par.zero == 3:
        # The weight pass (W) finds a stage's parameters through the graph its input pass (I)
        # saw; FSDP resharding them after forward swaps in other tensors and W loses gradients.
        # So these schedules keep each stage's parameters gathered from forward to W (ZeRO-2).
        stage_par = dataclasses.replace(par, zero=2)
    n_stages = p * v
    counts = stage_layer_counts(cfg.model, n_stages, cfg.data.seq_len, par.pp_split, par.layers_per_stage)
    layers = stage_layers(counts)
    pp_mesh = mesh["pp"]
    rank = pp_mesh.get_local_rank()
    stages = []
    for s in ps.rank_stages(par.pp_schedule, p, v, rank):
        part = build_stage_module(cfg.model, layers[s], s == 0, s == n_stages - 1)
        part = parallelize(part, dims, stage_par, mesh)
        materialize(part, cfg.train.seed, device)
        stages.append(PipelineStage(part, s, n_stages, device, group=pp_mesh.get_group()))
    positions = torch.arange(cfg.data.seq_len, device=device)
    return Pipeline(stages, par.pp_schedule, p, v, par.pp_microbatches, positions)
