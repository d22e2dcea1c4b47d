"""`ndtrain dryrun`: one rank of an N-rank job built and stepped on fake tensors, in a process of
its own (a process joins one process group, once), as outside scripts call it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"peak_memory_bytes", "memory_bytes", "flops", "collective_bytes", "planner", "operators", "host_reads"}


def dryrun(*args: str, hang_deadline) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ndtrain", "dryrun", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=hang_deadline(900))


def local_param_bytes(world: int, rank: int, **overrides) -> int:
    """What rank `rank` holds of every parameter under ZeRO-3 over `world` ranks: FSDP2 splits
    dim 0 into chunks of ceil(d0 / world) rows (rank r holds rows [r*c, (r+1)*c), padded to c)."""
    from ndtrain.config import load_config
    from ndtrain.model.llama import build_model

    cfg = load_config(None, [f"--{k}={v}" for k, v in overrides.items()])
    total = 0
    for p in build_model(cfg.model, "meta").parameters():
        rows = math.ceil(p.shape[0] / world)
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def test_zero3_at_world_64_counts_local_shards_only(hang_deadline):
    done = dryrun("--world", "64", "--rank", "5", "--json", "--train.global_batch=64", hang_deadline=hang_deadline)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert KEYS <= set(out) and out["rank"] == 5 and out["layout"] == "dp_shard=64"
    mem = out["memory_bytes"]
    # Local shards, not the global tensors (torch's FSDPMemTracker counts DTensors whole).
    assert mem["parameters"] == local_param_bytes(64, 5)
    assert out["peak_memory_bytes"] == sum(mem.values())
    assert {"parameters", "gradients", "optimizer_state", "peak_memory_bytes", "flops"} <= set(out["planner"]) | set(
        out["planner"]["memory_bytes"])
    # ZeRO-3: parameters gathered over dp_shard, gradients reduce-scattered over it.
    colls = out["collective_bytes"]
    assert colls["all_gather"]["dp_shard"]["calls"] > 0 and colls["reduce_scatter"]["dp_shard"]["calls"] > 0
    # all-gather in the planner's convention: the gathered output, 64 inputs.
    gather = colls["all_gather"]["dp_shard"]
    assert gather["bytes"] == 64 * gather["input_bytes"]
    assert out["flops"] > 0 and out["operators"]["forward"] > 0 and out["operators"]["backward"] > 0
    # The step reads no device value on the host (each a sync on a GPU); the logging interval's
    # one read is counted apart (tests/tools/test_dryrun_syncs.py).
    assert out["host_reads"] == [] and out["host_syncs"] == 1


def test_rank_all_reports_each_role_and_the_worst(hang_deadline):
    done = dryrun("--world", "8", "--rank", "all", "--json", "--train.global_batch=16", hang_deadline=hang_deadline)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert [r["rank"] for r in out["roles"]] == [0]  # no pipeline: one role
    assert out["worst_rank"] == 0 and out["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in out["roles"])


def run_json(*args: str, hang_deadline) -> dict:
    done = dryrun(*args, "--json", hang_deadline=hang_deadline)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def model_bytes(**overrides) -> int:
    """The whole model's parameters in fp32, as every DDP rank holds them."""
    return local_param_bytes(1, 0, **overrides)


def test_ddp_runs_on_the_ddp_reducer(hang_deadline):
    """dp_replicate alone: torch's DDP reducer (the composable `replicate`), as a real run of this
    layout takes it; every rank holds the whole model and all-reduces whole gradients."""
    out = run_json("--world", "4", "--train.global_batch=8", "--parallel.dp_shard=1", "--parallel.dp_replicate=4",
                   hang_deadline=hang_deadline)
    assert out["layout"] == "dp_replicate=4"
    mem, whole = out["memory_bytes"], model_bytes()
    assert mem["parameters"] == whole and mem["gradients"] == whole  # gradients: views of the reducer's buckets
    colls = out["collective_bytes"]
    assert set(colls) == {"all_reduce", "broadcast"}  # no FSDP gather or reduce-scatter
    # The buckets' gradients, plus the step's few fp32 scalars (loss and norm: under 64 bytes).
    assert 0 <= colls["all_reduce"]["dp_replicate"]["input_bytes"] - whole < 64
    assert colls["broadcast"]["dp_replicate"]["input_bytes"] == whole  # DDP's start: rank 0's values


PP = ("--world", "4", "--train.global_batch=8", "--parallel.pp=2", "--parallel.dp_shard=2", "--model.n_layers=4",
      "--train.micro_batch=1", "--rank", "all")


def check_pipeline_roles(out: dict) -> list[dict]:
    """Each pipeline rank a role of its own (pp coordinates 0 and 1), the worst the largest peak;
    activations go down the stages and gradients come back over pp."""
    roles = out["roles"]
    assert [r["rank"] for r in roles] == [0, 2] and [r["mesh_coordinates"]["pp"] for r in roles] == [0, 1]
    assert out["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in roles)
    assert out["rank"] == out["worst_rank"]
    for r in roles:
        colls = r["collective_bytes"]
        assert colls["send"]["pp"]["calls"] >= 2 and colls["recv"]["pp"]["calls"] >= 2  # 4 micro-batches
        assert r["operators"]["forward"] > 0 and r["operators"]["backward"] > 0
    return roles


@pytest.mark.heavy  # three processes (the parent and one per stage)
def test_pipeline_1f1b_reports_each_stage(hang_deadline):
    roles = check_pipeline_roles(run_json(*PP, "--parallel.pp_schedule=1F1B", hang_deadline=hang_deadline))
    # 1F1B: the first stage holds more micro-batches' activations in flight than the last.
    assert roles[0]["memory_bytes"]["activations"] > roles[1]["memory_bytes"]["activations"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, v", [("GPipe", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2),
                                         ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_every_pipeline_schedule_runs(schedule, v, hang_deadline):
    check_pipeline_roles(run_json(*PP, f"--parallel.pp_schedule={schedule}", f"--parallel.pp_virtual_stages={v}",
                                  hang_deadline=hang_deadline))


def test_moe_with_expert_parallel_assumes_balanced_routing(hang_deadline):
    """The all-to-all's split sizes are read on the host; fake tensors have no router choices, so
    the dry run answers them as balanced routing, and says so."""
    out = run_json("--config", "configs/moe-ep.toml", "--world", "4", "--parallel.dp_shard=4", "--parallel.ep=2",
                   "--parallel.mixed_precision=bf16", hang_deadline=hang_deadline)
    assert out["routing"].startswith("balanced") and "ep=2" in out["layout"]
    assert out["collective_bytes"]["all_to_all"]["ep"]["calls"] > 0
    assert any(r.startswith("ndtrain/parallel/expert.py") for r in out["host_reads"])  # a sync on a GPU too


def test_the_experts_grouped_gemm_counts_what_its_matmuls_one_by_one_count():
    """torch has no FLOP formula for the grouped GEMM (model/moe.py's experts): without the one
    compat/fake.py registers, a dry run of an MoE counted no expert FLOPs (mixtral-8x7b at 4
    layers on 64: 22.4 TFLOP, against the planner's 90.6). Forward and backward, against the same
    GEMMs run per group through torch's own mm formula."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ndtrain.compat.fake import count_grouped_mm_flops
    from ndtrain.model.moe import grouped_mm

    count_grouped_mm_flops()
    sizes = [4, 0, 8]  # an expert that got no token too
    x = torch.randn(sum(sizes), 8, requires_grad=True)
    w = torch.randn(len(sizes), 8, 16, requires_grad=True)
    g = torch.randn(sum(sizes), 16)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)

    def counted(run) -> int:
        with FlopCounterMode(display=False) as counter:
            (run() * g).sum().backward()
        return counter.get_total_flops()

    grouped = counted(lambda: grouped_mm(x, w, offs))
    one_by_one = counted(lambda: torch.cat([xg @ w[i] for i, xg in enumerate(torch.split(x, sizes))]))
    assert grouped == one_by_one == 3 * 2 * sum(sizes) * 8 * 16


SMALL = ("--world", "4", "--train.global_batch=8")


@pytest.mark.heavy  # two dry runs
def test_cpu_offload_moves_the_shards_state_to_host_memory(hang_deadline):
    plain = run_json(*SMALL, hang_deadline=hang_deadline)
    off = run_json(*SMALL, "--parallel.cpu_offload=true", hang_deadline=hang_deadline)
    host = off["host_memory_bytes"]
    for key in ("parameters", "gradients", "optimizer_state"):
        assert off["memory_bytes"][key] == 0
    assert host["parameters"] == plain["memory_bytes"]["parameters"] == local_param_bytes(4, 0)
    assert off["peak_memory_bytes"] < plain["peak_memory_bytes"]


@pytest.mark.slow
def test_activation_checkpoint_modes(hang_deadline):
    """none / selective / full / every_n: full holds the fewest activations and recomputes the
    most; a mode the planner does not model (every_n) still runs, its planner figures marked."""
    runs = {ac: run_json(*SMALL, f"--parallel.activation_checkpoint={ac}", hang_deadline=hang_deadline)
            for ac in ("none", "selective", "full", "every_n")}
    acts = {ac: r["memory_bytes"]["activations"] for ac, r in runs.items()}
    assert acts["full"] < acts["selective"] < acts["none"] and acts["full"] < acts["every_n"] < acts["none"]
    assert runs["full"]["flops"] > runs["none"]["flops"]
    assert runs["full"]["flops"] == pytest.approx(runs["full"]["planner"]["flops"], rel=0.10)
    assert "unavailable" in runs["every_n"]["planner"]


@pytest.mark.slow
def test_fp8_counts_the_wrapped_fp32_shards_as_parameters(hang_deadline):
    """torchao's fp8 all-gather wraps each fp32 shard; the parameters are what it wraps."""
    out = run_json(*SMALL, "--parallel.mixed_precision=fp8", hang_deadline=hang_deadline)
    assert out["memory_bytes"]["parameters"] == local_param_bytes(4, 0)
    assert out["memory_bytes"]["optimizer_state"] == pytest.approx(2 * local_param_bytes(4, 0), rel=0.01)


@pytest.mark.parametrize("args, says", [
    (["--world", "4", "--rank", "4"], "--rank must be in 0..3"),
    (["--world", "4", "--rank", "first"], "--rank must be an integer or 'all'"),
    (["--world", "0"], "--world must be >= 1"),
    (["--world", "64"], "train.global_batch"),
    # what fake tensors cannot run is refused before the build, not met as a traceback inside it
    (["--world", "4", "--model.preset=debug-moe", "--parallel.mixed_precision=bf16", "--model.capacity_factor=1.0"],
     "config key 'model.capacity_factor'"),
    (["--world", "4", "--model.preset=debug-moe"], "config key 'parallel.mixed_precision'"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, hang_deadline):
    done = dryrun(*args, hang_deadline=hang_deadline)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr[-2000:]


def test_the_watch_counts_no_meta_tensor():
    """The model is built on the meta device before it is materialised: those tensors hold no
    memory (counted, a TP model's whole-size meta weights made the build the 70B rank's peak)."""
    import torch

    from ndtrain.compat.fake import fake_tensor_mode, op_watcher
    from ndtrain.tools.dryrun_watch import Watch

    watch = Watch()
    with fake_tensor_mode(), op_watcher(watch.on_op):
        meta = torch.empty(1024, 1024, device="meta")
        here = torch.empty(256, dtype=torch.float32)
        assert meta.shape == (1024, 1024)
        assert watch.live == watch.peak == here.numel() * 4


def test_materialize_reads_no_window_of_a_fake_parameter(monkeypatch):
    """A dry run's parameters are fake: nothing to fill, so their shard window is never computed.
    For FSDP over TP (a strided shard) torch computes it by reading an index tensor row by row:
    under fake tensors two operators a row, 98,000 of the 70b rank's 100,000 build operators at
    2 layers, and most of its build time."""
    import torch

    from ndtrain.compat.fake import fake_tensor_mode, is_fake, swappable_fake_parameters
    from ndtrain.model import init

    def no_window(param):
        raise AssertionError("the window of a fake parameter was computed")

    monkeypatch.setattr(init, "_local_window", no_window)
    with fake_tensor_mode(), swappable_fake_parameters():
        model = init.materialize(torch.nn.Linear(4, 4, device="meta"), seed=0)
        assert is_fake(model.weight)
