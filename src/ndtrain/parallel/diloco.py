"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025) on the dp_replicate dimension.

Each replica (the pp x dp_shard x cp x tp ranks of one dp_replicate index) trains on its share of
every global batch with its own inner optimizer; FSDP and the trainer's scalar reductions stay
inside the replica. Every H inner steps the replicas average their outer gradient
Δ = θ_sync - θ_local over the dp_replicate group, and an outer SGD step with Nesterov momentum
moves the last synchronised parameters: θ_sync -= lr_out * (Δ̄ + μ·m) with m = μ·m + Δ̄. Every
replica then continues from the new θ_sync. With H = 1, lr_out = 1 and μ = 0 this is exactly
averaging the replicas after every step.

Streaming: the parameters are split into F fragments of whole layers, synced H/F steps apart, so
one fragment's traffic is in flight at a time. With `diloco_overlap_steps` = τ > 0 its all-reduce is started
asynchronously (on a group of its own) and applied τ inner steps later, merged as in Streaming
DiLoCo: θ_local = α θ_local + (1 - α) θ_sync with α = 1/2.

Everything works on local shards (DTensor.to_local()), which are laid out identically in every
replica, so FSDP, TP, pp and cp inside a replica need nothing special. This module needs only the
mesh and the parameters (it is the replicate dimension's synchronisation, beside data_parallel.py);
the trainer calls it after each optimizer step and the checkpointer through `checkpoint_view` /
`checkpoint_restore`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ndtrain.compat.torch import foreach_add, foreach_add_, foreach_mul_
from ndtrain.errors import NdtrainError
from ndtrain.model.init import canonical_name
from ndtrain.layout.diloco import fragment_of, last_send, sends_at
from ndtrain.parallel.grad_norm import shard_count
from ndtrain.parallel.groups import own_group

MERGE_ALPHA = 0.5  # Streaming DiLoCo's mixing of the local and the (late) global fragment
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's shard) as a tensor laid out like `param`, so DCP knows its offsets."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _groups(rank_grid: torch.Tensor, dim: int) -> list[list[int]]:
    """Rank lists of the fibres of `rank_grid` along `dim` (its own group per fibre)."""
    return rank_grid.movedim(dim, -1).reshape(-1, rank_grid.shape[dim]).tolist()




@dataclass
class _Tracked:
    name: str
    param: torch.nn.Parameter
    fragment: int


@dataclass
class _Pending:
    apply_at: int  # the step after which the reduced outer gradient is applied
    sent_at: int
    flat: torch.Tensor | None = None  # in flight: the all-reduce buffer
    work: object = None
    loss: torch.Tensor | None = None
    avg: list[torch.Tensor] = field(default_factory=list)  # completed: Δ̄ per parameter, fp32
    blocked_s: float = 0.0


class DiLoCo:
    def __init__(self, par, mesh, dims, model_parts, total_steps: int, n_layers: int):
        self.H, self.lr, self.mu = dims.diloco_inner_steps, par.diloco_outer_lr, par.diloco_outer_momentum
        self.F, self.tau, self.dtype = dims.diloco_fragments, dims.diloco_overlap_steps, DTYPES[dims.diloco_outer_dtype]
        self.total_steps = total_steps
        self.R = dims.dp_replicate
        self.replica = mesh["dp_replicate"].get_local_rank()
        # ranks over the mesh's dimensions in use (those larger than one), dp_replicate among them
        grid, rep = mesh.root.mesh, mesh.root.mesh_dim_names.index("dp_replicate")
        # Scalars that must agree across replicas (skip/rollback) use the mesh's replicate group;
        # the outer all-reduce gets a group of its own, so it can run in the background.
        self.flag_group = mesh["dp_replicate"].get_group()
        self.outer_group = own_group(_groups(grid, rep), "diloco_outer")
        self.replica_group = own_group(grid.movedim(rep, 0).reshape(self.R, -1).tolist(), "diloco_replica")
        self.ranks_per_stage = dims.world // self.R // dims.pp
        self.tracked: list[_Tracked] = []
        self.alias: dict[str, int] = {}  # canonical name (tied weights: every name) -> index
        seen: dict[int, int] = {}
        for part in model_parts:
            for name, p in part.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    continue
                name = canonical_name(name)
                if id(p) not in seen:
                    seen[id(p)] = len(self.tracked)
                    self.tracked.append(_Tracked(name, p, fragment_of(name, self.F, n_layers)))
                self.alias[name] = seen[id(p)]
        self.fragments = [[i for i, t in enumerate(self.tracked) if t.fragment == f] for f in range(self.F)]
        # The groups' device (cuda under NCCL): every tensor this class hands to a collective is
        # made on it, including those of a fragment this rank holds nothing of (a pipeline stage).
        self.device = _local(self.tracked[0].param).device if self.tracked else torch.device(mesh.root.device_type)
        with torch.no_grad():
            self.synced = [_local(t.param).detach().clone() for t in self.tracked]
            self.momentum = [torch.zeros_like(s) for s in self.synced] if self.mu > 0 else []
        self.pending: dict[int, _Pending] = {}
        self.outer_steps = [0] * self.F
        self.bytes_total = 0
        self._bytes_step = 0
        self._bytes_row = 0
        self.rows: list[dict] = []

    # ---- per step -----------------------------------------------------------------------------
    def _count(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.bytes_total += n
        self._bytes_step += n
        self._bytes_row += n

    def agree_start(self, flag: bool, device) -> tuple[torch.Tensor, object]:
        """Start the one cross-replica value of an inner step: whether any replica skipped it.
        Skip and rollback decisions must be the same on every rank; the 4 bytes travel while the
        optimizer steps (call `agree_finish` after it)."""
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        self._count(t)
        return t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.flag_group, async_op=True)

    @staticmethod
    def agree_finish(handle) -> bool:
        t, work = handle
        work.wait()
        return bool(t.item() > 0)

    def take_step_bytes(self) -> int:
        n, self._bytes_step = self._bytes_step, 0
        return n

    @torch.no_grad()
    def after_inner_step(self, step: int, loss: float) -> None:
        """Run the outer work due after inner step `step` (1-based): apply results that are due,
        send the fragments whose turn it is, and at the last step sync everything still apart."""
        for f in sorted(self.pending):
            if self.pending[f].apply_at == step:
                self._apply(f, step)
        for f in sends_at(step, self.H, self.F):
            self._send(f, step, loss)
            if self.tau == 0:
                self._apply(f, step)
        if step == self.total_steps:
            for f in sorted(self.pending):  # results still in flight land now
                self._apply(f, step)
            for f in range(self.F):
                if last_send(f, step, self.H, self.F) != step:  # else it was synced just now
                    self._send(f, step, loss)
                    self._apply(f, step, merge=False)

    def _send(self, f: int, step: int, loss: float) -> None:
        t0 = time.perf_counter()
        idx = self.fragments[f]
        deltas = [(self.synced[i] - _local(self.tracked[i].param)).reshape(-1) for i in idx]
        flat = torch.cat(deltas).to(self.dtype) if deltas else torch.zeros(0, dtype=self.dtype, device=self.device)
        loss_t = torch.tensor([loss], dtype=torch.float64, device=self.device)
        self._count(flat)
        self._count(loss_t)
        background = self.tau > 0 and step != self.total_steps
        work = dist.all_reduce(flat, group=self.outer_group, async_op=background)
        loss_work = dist.all_reduce(loss_t, group=self.outer_group, async_op=background)
        pend = _Pending(apply_at=step + (self.tau if background else 0), sent_at=step, flat=flat,
                        work=(work, loss_work) if background else None, loss=loss_t)
        pend.blocked_s = time.perf_counter() - t0
        self.pending[f] = pend

    def _complete(self, f: int) -> _Pending:
        """Wait for fragment f's all-reduce and turn it into Δ̄ per parameter (fp32)."""
        pend = self.pending[f]
        if pend.flat is None:
            return pend
        t0 = time.perf_counter()
        if pend.work is not None:
            for w in pend.work:
                w.wait()
        pend.avg, offset = [], 0
        for i in self.fragments[f]:
            n = self.synced[i].numel()
            # Own storage per tensor: a DTensor over a view with a storage offset reports a bogus
            # data_ptr, and DCP's async stager then fails to copy it.
            piece = pend.flat[offset:offset + n].to(torch.float32, copy=True).div_(self.R)
            pend.avg.append(piece.view_as(self.synced[i]))
            offset += n
        pend.flat, pend.work = None, None
        pend.blocked_s += time.perf_counter() - t0
        return pend

    def _apply(self, f: int, step: int, merge: bool = True) -> None:
        pend = self._complete(f)
        t0 = time.perf_counter()
        del self.pending[f]
        idx = self.fragments[f]
        synced = [self.synced[i] for i in idx]
        grads = pend.avg
        if idx:  # torch's foreach ops refuse an empty list (a fragment this stage holds nothing of)
            if self.mu > 0:
                mom = [self.momentum[i] for i in idx]
                foreach_mul_(mom, self.mu)
                foreach_add_(mom, grads)
                update = foreach_add(grads, mom, alpha=self.mu)  # Nesterov: Δ̄ + μ·m
            else:
                update = grads
            foreach_add_(synced, update, alpha=-self.lr)
        late = merge and pend.apply_at > pend.sent_at  # inner steps ran while it was in flight
        for i, s in zip(idx, synced):
            local = _local(self.tracked[i].param)
            if late:
                local.mul_(MERGE_ALPHA).add_(s, alpha=1 - MERGE_ALPHA)
            else:
                local.copy_(s)
        self.outer_steps[f] += 1
        # Summed on the device and read in take_rows: no host sync inside the step.
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i, g in zip(idx, grads):
            sq += g.double().pow(2).sum() * (shard_count(self.tracked[i].param) / self.ranks_per_stage)
        dist.all_reduce(sq, group=self.replica_group)  # inside the replica: Δ̄ is the same in every one
        self.rows.append({"step": step, "outer_step": self.outer_steps[f], "fragment": f,
                          "outer_grad_norm": sq, "cross_replica_bytes": self._bytes_row,
                          "sync_s": pend.blocked_s + time.perf_counter() - t0,
                          "loss_across_replicas": pend.loss, "sent_at": pend.sent_at})
        self._bytes_row = 0

    def take_rows(self) -> list[dict]:
        """The outer steps since the last call, their device values read now (once per step)."""
        rows, self.rows = self.rows, []
        for row in rows:
            row["outer_grad_norm"] = math.sqrt(float(row["outer_grad_norm"]))
            row["loss_across_replicas"] = float(row["loss_across_replicas"]) / self.R
        return rows

    def wait_all(self) -> None:
        for f in self.pending:
            self._complete(f)

    # ---- checkpoint state ---------------------------------------------------------------------
    def settings(self) -> dict:
        """The schedule: a round in progress cannot change it."""
        return {"inner_steps": self.H, "fragments": self.F, "overlap_steps": self.tau}

    def info(self) -> dict:
        """For train_state.json: what a resume must know before it reads any tensor."""
        return {"replicas": self.R, **self.settings(), "pending": sorted(self.pending),
                "outer_steps": list(self.outer_steps)}

    def state_dict(self, pending: list[int] | None = None) -> dict:
        """The outer state: last synchronised parameters, Nesterov momentum, outer gradients still
        to be applied. The same in every replica, sharded inside a replica like the parameters.
        `pending` (on load) names the fragments the checkpoint holds results for."""
        self.wait_all()
        pending = sorted(self.pending) if pending is None else pending
        out: dict = {"synced": {t.name: _like(t.param, s) for t, s in zip(self.tracked, self.synced)}}
        if self.mu > 0:
            out["momentum"] = {t.name: _like(t.param, m) for t, m in zip(self.tracked, self.momentum)}
        for f in pending:
            pend = self.pending.get(f) or _Pending(0, 0, loss=torch.zeros(1, dtype=torch.float64, device=self.device),
                                                   avg=[torch.zeros_like(self.synced[i]) for i in self.fragments[f]])
            self.pending[f] = pend
            out[f"pending{f}"] = {"loss": pend.loss, **{self.tracked[i].name: _like(self.tracked[i].param, a)
                                                         for i, a in zip(self.fragments[f], pend.avg)}}
        return out

    def load_state_dict(self, sd: dict, step: int, outer_steps: list[int] | None = None) -> None:
        """`sd` is `state_dict(pending)` after loading (checkpoint at `step`); copy it home. The
        replica's live parameters and inner optimizer are the checkpointer's to set."""
        with torch.no_grad():
            for t, s in zip(self.tracked, self.synced):
                s.copy_(_local(sd["synced"][t.name]))
            if self.mu > 0:
                for t, m in zip(self.tracked, self.momentum):
                    if "momentum" in sd:
                        m.copy_(_local(sd["momentum"][t.name]))
                    else:  # the checkpoint ran without momentum
                        m.zero_()
        for f in list(self.pending):
            key = f"pending{f}"
            if key not in sd:
                del self.pending[f]
                continue
            pend = self.pending[f]
            pend.avg = [_local(sd[key][self.tracked[i].name]).clone() for i in self.fragments[f]]
            pend.loss = sd[key]["loss"].clone()
            pend.sent_at = last_send(f, step, self.H, self.F)
            pend.apply_at = pend.sent_at + self.tau
        self.outer_steps = list(outer_steps) if outer_steps else [0] * self.F
        self._bytes_row = 0

    def reset_to(self, model_sd: dict) -> None:
        """Start DiLoCo from plain weights (a per-step-sync checkpoint): θ_sync = those weights."""
        self.wait_all()
        self.pending.clear()
        with torch.no_grad():
            for name, i in self.alias.items():
                if name in model_sd:
                    self.synced[i].copy_(_local(model_sd[name]))
            for m in self.momentum:
                m.zero_()
        self.outer_steps = [0] * self.F

    def model_view(self, model_sd: dict) -> dict:
        """The checkpoint's "model": θ_sync under the model's own keys (the global model every
        reader of a checkpoint gets), buffers as they are."""
        out = {}
        for key, value in model_sd.items():
            i = self.alias.get(key)
            out[key] = value if i is None else _like(self.tracked[i].param, self.synced[i])
        return out


# ---- the checkpointer's hooks ---------------------------------------------------------------
def _saved_info(saved: dict | None) -> dict | None:
    return (saved or {}).get("diloco") or None


def checkpoint_view(diloco: DiLoCo | None, state: dict, saved: dict | None = None) -> dict:
    """What the checkpointer saves (saved=None) or loads (saved = the checkpoint's train_state),
    given its {"model", "optim"} of this rank. Under DiLoCo a checkpoint holds "model" = θ_sync
    (the global model), "diloco" = the outer state, and per replica r "replica<r>" = that
    replica's live model and inner optimizer, so a resume with the same replicas is exact at any
    step. Loading with R' replicas, replica r takes replica r mod R's inner state; a step-sync
    run takes θ_sync and replica 0's optimizer; DiLoCo from a step-sync checkpoint starts a
    round from its weights."""
    info = _saved_info(saved)
    if diloco is None:
        return state if not info else {"model": state["model"], "replica0": {"optim": state["optim"]}}
    if saved is not None and not info:
        return state
    for key, value in diloco.settings().items() if info else ():
        if info.get(key) != value:
            raise NdtrainError(f"the checkpoint ran parallel.diloco_{key}={info.get(key)} but this run has {value}; "
                               f"resume with the same value (a round in progress cannot change its schedule)")
    src = diloco.replica if not info else diloco.replica % info["replicas"]
    outer = diloco.state_dict(None if not info else info["pending"])
    return {"model": diloco.model_view(state["model"]), "diloco": {k: v for k, v in outer.items() if k != "synced"},
            f"replica{src}": state}


def checkpoint_restore(diloco: DiLoCo | None, view: dict, saved: dict) -> dict:
    """After the tensors of `checkpoint_view(..., saved)` were loaded: restore the outer state and
    return the {"model", "optim"} the checkpointer sets into the live model and optimizer."""
    info = _saved_info(saved)
    if diloco is None:
        return view if not info else {"model": view["model"], "optim": view["replica0"]["optim"]}
    if not info:
        diloco.reset_to(view["model"])
        return view
    inner = view[f"replica{diloco.replica % info['replicas']}"]
    outer = dict(view["diloco"])
    outer["synced"] = {t.name: view["model"][t.name] for t in diloco.tracked}
    diloco.load_state_dict(outer, saved["step"], info.get("outer_steps"))
    return inner
