"""`ndtrain dryrun --config C --world N [--rank R | --rank all] [--json]`: rank R's part of an
N-rank job, built and trained for one step on this CPU, with nothing real but the shapes.

The rank joins a process group of N ranks that exist only in name (torch's `fake` backend:
collectives return at once), and every tensor is fake (a shape, a dtype, no memory). Then the
run's own code runs: train/build.py's `build(cfg, layout)` (mesh, model on the meta device,
parallelised, materialised; the optimizer) and train/step.py's `train_step` on a batch the
run's own loader cuts from synthetic tokens (every micro-batch, the pipeline schedule's own
order, clipping, the optimizer). tools/dryrun_watch.py watches every operator it launches; what
it measures is printed beside what the planner predicts for the same layout (dryrun_report.py).

The device is the CPU (fake CUDA tensors cannot run autograd on a CPU-only torch), with the
run's dtypes; the Gloo-only paths a CPU run takes (FSDP's all-to-all reduce-scatter, async
unshards) are the same paths a CPU run of this layout takes. torch.compile is not run (its
graphs would be compiled for fake tensors; the eager step is what is measured)."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys

import numpy as np
import torch

from ndtrain.config import load_config
from ndtrain.errors import ConfigError, NdtrainError, UsageError


class SyntheticTokens:
    """A training split of token zeros, long enough for any step: the loader cuts the run's
    batches from it as from a corpus, and nothing is read from disk."""

    split = "train"
    manifest: dict = {}

    def __init__(self, vocab_size: int, eos_id: int | None = None):
        self.vocab_size, self.eos_id = vocab_size, eos_id

    def __len__(self) -> int:
        return 1 << 40

    def num_samples(self, seq_len: int) -> int:
        return 1 << 16  # more than any step's batch; the loader shuffles this many per epoch

    def windows(self, indices: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(len(indices), seq_len, dtype=torch.int64)
        return zeros, zeros.clone()

    def describe(self) -> str:
        return "synthetic tokens (dry run)"


def dry_config(cfg):
    """The run's config as the dry run builds it: on the CPU, no prefetch thread, no compile."""
    cfg = copy.deepcopy(cfg)
    cfg.train.device = "cpu"
    cfg.data.prefetch = 0
    cfg.parallel.compile = False
    return cfg


def refuse_unsupported(cfg) -> None:
    """What fake tensors cannot run, refused in one line before the build, naming the key.
    MoE capacity dropping gathers the kept assignments with nonzero, whose size is the router's
    choice (no fake tensor has it); torch's grouped GEMM meta rule takes bf16 only."""
    m, mp = cfg.model, cfg.parallel.mixed_precision
    if m.n_experts and m.capacity_factor > 0:
        raise ConfigError("model.capacity_factor", f"{m.capacity_factor}: the dry run cannot drop tokens (how many "
                          f"is the router's choice); run it with --model.capacity_factor=0, every token "
                          f"kept: an upper bound")
    if m.n_experts and mp not in ("bf16", "fp8"):
        raise ConfigError("parallel.mixed_precision", f"{mp!r}: the dry run of an MoE needs bf16 (torch's grouped GEMM "
                          f"meta rule takes nothing else); run it with --parallel.mixed_precision=bf16, as a GPU does")


def resolved(cfg, world: int):
    """(the config that trains, its layout) for `world` ranks, as `ndtrain train` resolves them
    (the planner's choices where the config leaves them open), without probing this host."""
    from ndtrain.parallel import dims as pdims
    from ndtrain.train.plan import planned_config

    cfg = planned_config(cfg, world)
    return cfg, pdims.checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, cfg.train, cfg.data)


def run_rank(cfg, world: int, rank: int, steps: int = 1) -> dict:
    """Builds rank `rank` of `world` and trains one step; what it measured. `steps` > 1: that many
    steps make one logging interval whose host syncs are counted (dryrun_syncs.py)."""
    from ndtrain.compat.fake import (count_cpu_attention_flops, count_grouped_mm_flops, dtensor_shape_inference,
                                     fake_tensor_mode,
                                     ddp_without_shape_check, init_fake_group, op_watcher,
                                     swappable_fake_parameters)
    from ndtrain.tools.dryrun_syncs import HostReads, answer_host_probes, finish_interval
    from ndtrain.tools.dryrun_experts import ROUTING, balanced_exchanges
    from ndtrain.tools.dryrun_pipeline import neighbours_answered
    from ndtrain.tools.dryrun_watch import Watch, enter_shadow, leave_shadow, watching_resize
    from ndtrain.model.llama import set_cpu_bf16_attention
    from ndtrain.parallel.dims import build_mesh
    from ndtrain.train.build import build
    from ndtrain.train.step import next_batch, train_step

    cfg, layout = resolved(dry_config(cfg), world)
    init_fake_group(rank, world)
    count_cpu_attention_flops()
    count_grouped_mm_flops()
    mesh = build_mesh(layout, "cpu")
    names = mesh_groups(mesh, layout)  # every view made now, while its rank tables can be computed
    watch = Watch()
    answer_host_probes()
    shadow = dtensor_shape_inference(lambda: enter_shadow(watch), lambda: leave_shadow(watch))
    with fake_tensor_mode(), op_watcher(watch.on_op), watching_resize(watch), shadow, \
            swappable_fake_parameters(), ddp_without_shape_check():
        state = build(cfg, layout, train_set=SyntheticTokens(cfg.model.vocab_size, 0), mesh=mesh)
        for part in state.model_parts:  # bf16 attends in bf16, as on a GPU (not the CPU kernel's fp32 detour)
            set_cpu_bf16_attention(part, "bf16")
        params = watch.serials(state.params)
        expert_exchanges = balanced_exchanges(state.model_parts, watch)
        grads: set = set()

        def before_update(optimizer, *_):
            grads.update(watch.serials(p.grad for p in state.params))
            watch.phase = "optimizer"

        state.optimizer.register_step_pre_hook(before_update)
        state.optimizer.register_step_post_hook(lambda *_: setattr(watch, "phase", "after step"))
        for part in state.model_parts:  # every forward (each micro-batch, each pipeline stage) starts here
            part.register_forward_pre_hook(lambda *_: setattr(watch, "phase", "forward"))
        watch.phase = "data"
        batch, _ = next_batch(state)
        watch.phase = "forward"
        watch.step_started()
        reads = HostReads(lambda: len(watch.host_reads))  # a read the watch answered was of a device value
        with reads, neighbours_answered(state, watch):
            train_step(state, batch)
        watch.finish()
        optim = watch.serials(_local_states(state.optimizer))
        memory = watch.categories(params, grads, optim)
        # Adam's state is made by the first step's update and held from the start of every later
        # step: a peak reached before this first update holds it too in the steady state.
        optim_bytes = sum(t.untyped_storage().nbytes() for t in _local_states(state.optimizer))
        first_peak = sum(memory.values())
        memory["optimizer_state"] = max(memory["optimizer_state"], optim_bytes)
        host = offloaded(memory) if layout.cpu_offload else {}
        out = {"rank": rank, "world": world, "layout": layout.describe(), "mesh_coordinates": coordinates(state),
               "peak_memory_bytes": sum(memory.values()), "memory_bytes": memory, "peak_phase": watch.peak_phase,
               "first_step_peak_memory_bytes": first_peak,
               "flops": watch.flops, "operators": dict(watch.ops), "collective_bytes": watch.collective_table(names),
               "host_reads": list(watch.host_reads), "config": cfg, "layout_obj": layout}
        if host:
            out["host_memory_bytes"] = host
        if expert_exchanges:
            out["routing"] = ROUTING
        # The first step's figures are taken: the interval's other steps and its read are counted only.
        out.update(finish_interval(state, reads, steps, lambda: train_step(state, next_batch(state)[0])))
    return out


def offloaded(memory: dict) -> dict:
    """CPU offload (FSDP2's): the parameter shards, their gradients and the optimizer's state
    live in host memory, and the update runs there. A dry run holds everything on the CPU, so
    those categories move out of the device's figures (into `host_memory_bytes`); the device
    keeps what is gathered, the activations and the copies in flight."""
    host = {k: memory[k] for k in ("parameters", "gradients", "optimizer_state")}
    memory.update(dict.fromkeys(host, 0))
    return host


def _local_states(optimizer) -> list:
    """The optimizer's state tensors, as this rank's local shards."""
    from ndtrain.tools.dryrun_watch import local_tensor

    return [local_tensor(t) for per_param in optimizer.state.values() for t in per_param.values()
            if isinstance(t, torch.Tensor)]


def coordinates(state) -> dict:
    from ndtrain.parallel.dims import MESH_ORDER

    return {n: state.mesh.coordinate(n)[0] for n in MESH_ORDER if state.mesh.coordinate(n)[1] > 1}


def mesh_groups(mesh, layout) -> dict[str, str]:
    """Process group name -> the mesh dimension (or view) it is, "world" for the default group."""
    import torch.distributed as dist

    from ndtrain.parallel.dims import MESH_ORDER, VIEWS

    out = {}
    names = list(MESH_ORDER) + list(VIEWS) + (["ep", "ep_fsdp"] if layout.ep > 1 else [])
    for name in names:
        view = mesh[name]
        dims = getattr(view, "mesh_dim_names", None)
        if dims is None:
            continue  # a dimension of size one: no group
        for i, dim in enumerate(dims):
            out.setdefault(view.get_group(i).group_name, dim)
    out.setdefault(dist.group.WORLD.group_name, "world")
    return out


def roles(layout) -> list[int]:
    """One rank per distinct role: the first rank of each pipeline stage (every other
    coordinate 0). Expert groups differ only in which experts they hold, and ranks of one
    stage only in which shard: under balanced routing each holds the same bytes and work."""
    from ndtrain.parallel.dims import MESH_ORDER

    stride = int(np.prod(layout.shape[1:])) if MESH_ORDER[0] == "pp" else 1
    return [s * stride for s in range(layout.pp)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain dryrun", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML file (default: built-in defaults)")
    p.add_argument("--world", type=int, required=True, help="number of ranks of the job")
    p.add_argument("--rank", default="0", help="the rank to build and step, or 'all': each distinct role")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int, default=1,
                   help="steps of one logging interval whose host syncs are counted (the first is measured)")
    args, rest = p.parse_known_args(argv)
    if args.world < 1:
        raise UsageError(f"--world must be >= 1, got {args.world}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    cfg = load_config(args.config, rest)
    refuse_unsupported(cfg)
    from ndtrain.tools.dryrun_report import compare, text

    if args.rank == "all":
        _, layout = resolved(dry_config(cfg), args.world)
        results = [_in_subprocess(argv, r) for r in roles(layout)]
        worst = max(results, key=lambda r: r["peak_memory_bytes"])
        out = {**worst, "roles": results, "worst_rank": worst["rank"]}
        from ndtrain.tools.dryrun_syncs import most_syncs

        out.update(most_syncs(results))
    else:
        try:
            rank = int(args.rank)
        except ValueError:
            raise UsageError(f"--rank must be an integer or 'all', got {args.rank!r}") from None
        if not 0 <= rank < args.world:
            raise UsageError(f"--rank must be in 0..{args.world - 1}, got {rank}")
        out = compare(run_rank(cfg, args.world, rank, args.steps))
    print(json.dumps(out) if args.json else text(out))
    return 0


def _in_subprocess(argv: list[str], rank: int) -> dict:
    """One role's dry run in a process of its own: a process joins one (fake) group, once."""
    rest = [a for i, a in enumerate(argv) if a != "--json" and not (a == "--rank" or argv[i - 1] == "--rank"
                                                                    or a.startswith("--rank="))]
    done = subprocess.run([sys.executable, "-m", "ndtrain", "dryrun", *rest, "--rank", str(rank), "--json"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise NdtrainError(f"the dry run of rank {rank} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)
