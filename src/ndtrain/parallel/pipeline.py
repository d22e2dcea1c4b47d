"""Pipeline parallel: split the decoder into stages, build only this rank's stages, and run a
torch.distributed.pipelining schedule over them with the trainer's exact loss normalisation.

A stage is the ordinary `Transformer` with the parts it does not own deleted (layers dropped from
the ModuleDict, embedding/norm/head set to None), so every parameter keeps its canonical name:
layout-independent init fills it, and checkpoints reshard between pipeline and other layouts.
Each stage goes through the same `parallelize` (TP, AC, compile, FSDP) as a whole model, on the
sub-meshes of this rank's pipeline coordinate.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndtrain.compat.torch import shape_inference_in_eval
from ndtrain.errors import NdtrainError
from ndtrain.layout import schedules as registry
from ndtrain.layout.rules import microbatch_split_problem
from ndtrain.layout.partition import part_costs, pipeline_split, stage_layer_counts, stage_layers  # noqa: F401
from ndtrain.model.config import ModelConfig
from ndtrain.parallel import pipeline_schedule as ps
from ndtrain.parallel.groups import own_group


# ---- stages --------------------------------------------------------------------------------

def build_stage_module(cfg: ModelConfig, layers: list[int], first: bool, last: bool) -> nn.Module:
    """One stage of the model on meta (nothing allocated, and nothing built for the other stages)."""
    from ndtrain.model.llama import build_model

    return build_model(cfg, "meta", layers, first, last)


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
        self.tied: TiedEmbedding | None = None
        # Timeline recording for `ndtrain pipeline-report`: off while training normally, and the
        # stages' chunk methods are wrapped only while it is on (see `trace`).
        self._trace = False
        self.traces: list[dict] = []
        self._events: list[tuple] | None = None
        self._t0 = 0.0
        for part in self.parts:
            # First among the hooks: context parallel's check that positions are given runs after.
            part.register_forward_pre_hook(self._add_positions, with_kwargs=True, prepend=True)
        for stage in stages:
            # On a schedule's first step torch infers shapes by running each stage once more; that
            # forward runs in eval mode, out of MoE's routing statistics (private torch: compat).
            shape_inference_in_eval(stage)

    @property
    def trace(self) -> bool:
        return self._trace

    @trace.setter
    def trace(self, on: bool) -> None:
        """Record each stage action's times (`traces`) from now on, or stop: the wrappers that
        record them are put on the stages here and taken off again, so a run that never traces
        runs torch's own methods."""
        if on and not self._trace:
            for stage in self.stages:
                self._instrument(stage)
        elif self._trace and not on:
            for stage in self.stages:
                for name in _CHUNK_METHODS:
                    stage.__dict__.pop(name, None)  # torch's method, from the class, again
        self._trace = bool(on)

    def _add_positions(self, module, args, kwargs):
        # A later stage receives hidden states, sequence-sharded under SP (and holding a cp
        # rank's share of the sequence under CP): the model cannot infer the token positions from
        # them, so every stage is handed the true global ones.
        if len(args) < 2 and kwargs.get("positions") is None:
            kwargs = {**kwargs, "positions": self._positions}
        return args, kwargs

    def microbatches(self, rows: int, micro_batch: int) -> int:
        m = ps.microbatch_count(self.pp_microbatches, rows, micro_batch)
        problem = microbatch_split_problem(rows, m)  # the layout's rule, for the batch this step has
        if problem:
            raise NdtrainError(problem)
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

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int,
            train: bool = True) -> torch.Tensor | float:
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
        if train and self.tied is not None:
            self.tied.sum_grads()
        if not self.has_last:
            return 0.0
        # Metadata inference on a schedule's first step calls the loss once more: keep the last m.
        # Summed on the device and left there (the step reads it with the rest, once per logging
        # interval: train/step.py's read_steps); a read here would be a host sync each step on a GPU.
        return torch.stack([_full(t).reshape(()) for t in self._loss_sums[-m:]]).double().sum()

    def _instrument(self, stage) -> None:
        """Wrap the stage's chunk methods (public PipelineStage methods, set on the instance) to
        record each action; `trace = False` takes them off."""
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


_CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build_pipeline(cfg, dims, mesh, device: torch.device, positions: torch.Tensor | None = None) -> Pipeline:
    """Build, parallelise and materialise only this rank's stages; wrap them in a Pipeline.
    `dims` is the resolved layout; `positions` the global positions of this rank's tokens (the
    cp shard's, under context parallel), handed to every stage for RoPE."""
    from torch.distributed.pipelining import PipelineStage

    from ndtrain.model.init import materialize
    from ndtrain.parallel.compose import parallelize

    p, v = dims.pp, dims.pp_virtual_stages
    n_stages = p * v
    counts = pipeline_split(cfg.model, cfg.data.seq_len, dims)
    layers = stage_layers(counts)
    pp_mesh = mesh["pp"]
    rank = pp_mesh.get_local_rank()
    stages = []
    for s in registry.get(dims.pp_schedule).rank_stages(p, v, rank):
        part = build_stage_module(cfg.model, layers[s], s == 0, s == n_stages - 1)
        part = parallelize(part, dims, mesh)
        materialize(part, cfg.train.seed, device)
        stages.append(PipelineStage(part, s, n_stages, device, group=pp_mesh.get_group()))
    if positions is None:
        positions = torch.arange(cfg.data.seq_len, device=device)
    pipe = Pipeline(stages, dims.pp_schedule, p, v, dims.pp_microbatches, positions)
    if cfg.model.tie_embeddings:
        pipe.tied = TiedEmbedding(pipe.parts, mesh, dims)
    return pipe


class TiedEmbedding:
    """Tied input and output embeddings across pipeline stages. The first stage holds the
    embedding, the last stage its own copy as the head's weight (initialised from the same name,
    so equal). After each backward their gradients are summed, in place on both, so both take the
    same optimizer step and stay equal; the gradient norm counts the weight once (the copy is
    marked). Checkpoints keep both canonical names, as a single process's state dict does.

    Where the two stages live on one rank (V schedules: stages 0 and 2p-1 on rank 0) the sum is
    local; otherwise a two-rank group joins pipeline ranks 0 and p-1 at each (dp, cp, tp) coordinate."""

    def __init__(self, parts, mesh, dims):
        self.embed = self.head = None
        for part in parts:
            for name, param in part.named_parameters():
                if name.endswith("tok_embeddings.weight"):
                    self.embed = param
                elif name.endswith("output.weight"):
                    self.head = param
                    param._ndtrain_tied_copy = True  # counted once, by the embedding
        self.group = None
        local = registry.get(dims.pp_schedule).stage_ranks(dims.pp,
                                                           dims.pp_virtual_stages)[-1] == 0  # V: last stage on rank 0
        if not local:
            ranks = mesh.ranks  # [pp, dp_replicate, dp_shard, cp, tp] -> global rank
            flat = ranks.reshape(ranks.shape[0], -1)
            pairs = [[int(flat[0, c]), int(flat[-1, c])] for c in range(flat.shape[1])]
            middle = [[int(r)] for r in flat[1:-1].flatten()]  # stages between: a group of one each
            group = own_group(pairs + middle, "tied_embedding")
            if any(dist.get_rank() in pair for pair in pairs):
                self.group = group

    @staticmethod
    def _grad(param) -> torch.Tensor:
        """The parameter's gradient as a local tensor laid out like the parameter (TP can leave
        an embedding's gradient replicated while its weight is vocab-sharded)."""
        g = param.grad
        if g is None:
            param.grad = g = torch.zeros_like(param)
        if hasattr(g, "placements") and tuple(g.placements) != tuple(param.placements):
            param.grad = g = g.redistribute(param.device_mesh, param.placements)
        return g.to_local() if hasattr(g, "to_local") else g

    @torch.no_grad()
    def sum_grads(self) -> None:
        if self.embed is not None and self.head is not None:  # both on this rank
            total = self._grad(self.embed) + self._grad(self.head)
            self._grad(self.embed).copy_(total)
            self._grad(self.head).copy_(total)
            return
        mine = self.embed if self.embed is not None else self.head
        if mine is not None and self.group is not None:
            dist.all_reduce(self._grad(mine), group=self.group)
