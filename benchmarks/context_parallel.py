"""Context parallel: tokens/s and peak activation memory per rank vs sequence length, cp = 1, 2, 4.

Each (seq_len, cp) point trains a few steps of one sequence per step (global batch 1) on the
prepared corpus; cp ranks are forked Gloo processes, one thread each. Activation memory is the
bytes autograd saves for backward (tests/parallel/activation_meter.py), per rank; throughput uses the
fastest of the measured steps after one warm-up step (the least disturbed by other processes
on a shared host). Read the ratios: this host has 2 cores, so cp=1 uses one, cp=2 both, and
cp=4 oversubscribes them 2x.

    python benchmarks/context_parallel.py --seq 2048 4096 8192 --out docs/benchmarks_context.md

`--attention` instead times the attention kernel alone on one rank (a cp group of one: the ring
code, its block-kernel dispatch and merge, one causal block) against SDPA (flash on a GPU) at
Llama 3 8B's heads (32 query, 8 K/V, head_dim 128, bf16) and prints, per path, forward+backward
time, memory and the largest difference from SDPA; `--portable` adds the unfused path. On a GPU:

    PYTHONPATH=src python benchmarks/context_parallel.py --attention --portable --seq 8192

`--dry-run` runs the same on CPU at tiny shapes in fp32 (a few seconds; the test suite runs it),
and one short training point at cp=1 and cp=2 when `--data` names a prepared corpus.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The activation meter is test code (not shipped): tests/parallel/activation_meter.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))

import torch  # noqa: E402

from ndtrain.config import load_config  # noqa: E402


def job(data: str, seq: int, cp: int, mode: str, model: dict):
    return load_config(None, {
        "model": {**model, "max_seq_len": max(seq, 2048)},
        "data": {"path": data, "seq_len": seq},
        "optimizer": {"warmup_steps": 0, "schedule": "constant"},
        "train": {"global_batch": 1, "micro_batch": 1, "seed": 0},
        "parallel": {"cp": cp, "dp_shard": 1, "cp_attention": mode},
        "logging": {"tensorboard": False, "progress": "off"}})


def measure(cfg, steps: int) -> dict:
    from activation_meter import SavedActivationMeter  # tests/parallel/, on sys.path above
    from ndtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(cfg, run_dir=None, log=False)
    times, cpu, peak = [], [], 0
    for i in range(steps + 1):
        with SavedActivationMeter() as meter:
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
        peak = max(peak, meter.peak_bytes)
        if i:  # the first step warms up allocators and kernels
            times.append(dt)
            cpu.append(dc)
    return {"step_s": min(times), "cpu_s": min(cpu), "peak": peak}


def point(data: str, seq: int, cp: int, mode: str, model: dict, steps: int) -> dict:
    cfg = job(data, seq, cp, mode, model)
    if cp == 1:
        return measure(cfg, steps)
    from ndtrain.parallel.launch import run_ranks

    per_rank = run_ranks(cp, measure, cfg, steps, timeout_s=600)
    # A step ends when the slowest rank ends; memory is reported for the fullest rank; CPU time
    # (all threads, Gloo's included) is summed over ranks: the work cp costs, whatever the load.
    return {"step_s": max(r["step_s"] for r in per_rank), "peak": max(r["peak"] for r in per_rank),
            "cpu_s": sum(r["cpu_s"] for r in per_rank)}


# ---- the attention kernel alone, one rank -----------------------------------------------------
def _timed(fns: dict, dev, reps: int) -> dict:
    """Median seconds of each of `fns`, called in turn (interleaved, so a shared host's drifting
    load falls on every path alike), after a warm-up call each."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _memory(fn, dev) -> float:
    """MiB: on CUDA the peak allocated above what was live before (temporaries included); on CPU,
    which has no allocator statistics, the bytes autograd saved for backward."""
    if dev.type == "cuda":
        _sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        fn()
        _sync(dev)
        return (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    from activation_meter import SavedActivationMeter  # tests/parallel/, on sys.path above

    with SavedActivationMeter() as meter:
        fn()
    return meter.peak_bytes / 2**20


def attention(seq: int, dry: bool, portable: bool, reps: int) -> list[dict]:
    import torch.distributed as dist

    from ndtrain.parallel.ring_attention import CPComm

    dev = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
    b, h, h_kv, d = (1, 4, 2, 32) if dry else (1, 32, 8, 128)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(b, n, seq, d, generator=g).to(dev, dtype) for n in (h, h_kv, h_kv, h))
    own_group = not dist.is_initialized()
    if own_group:  # a cp group of one rank; its K/V never leave the device
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _attention_rows(q, k, v, go, CPComm(dist.group.WORLD, "ring"), portable, reps)
    finally:
        if own_group:
            dist.destroy_process_group()


def _attention_rows(q, k, v, go, comm, portable: bool, reps: int) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ndtrain.model.llama import expand_kv
    from ndtrain.parallel.block_attention import kernel_for
    from ndtrain.parallel.ring_attention import context_attention

    dev, (_, h, seq, d), h_kv = q.device, q.shape, k.shape[1]

    def run(fn):
        def step():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            out.backward(go)
            return [out.detach()] + [t.grad for t in leaves]
        return step

    def sdpa(q_, k_, v_):
        # The flash backend (CPU's or CUDA's), on K/V expanded as the model's own attention does.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q_, expand_kv(k_, h), expand_kv(v_, h), is_causal=True)

    paths = {"sdpa": sdpa,
             f"cp ({kernel_for(q, False).name})": lambda *t: context_attention(*t, comm)}
    if portable:
        paths["cp (portable)"] = lambda *t: context_attention(*t, comm, fused=False)
    steps = {name: run(fn) for name, fn in paths.items()}
    ref = steps["sdpa"]()
    seconds = _timed(steps, dev, reps)
    rows = []
    for name, step in steps.items():
        diff = max(float((a.float() - r.float()).abs().max()) for a, r in zip(step(), ref))
        rows.append({"path": name, "ms": 1e3 * seconds[name], "mib": _memory(step, dev), "diff": diff})
    what = f"seq {seq}, {h} q / {h_kv} kv heads x {d}, {q.dtype}, {dev.type}"
    for r in rows:
        print(f"{what}  {r['path']:>16}: fwd+bwd {r['ms']:8.2f} ms  memory {r['mib']:9.1f} MiB  "
              f"max |diff| vs sdpa {r['diff']:.2e}", flush=True)
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["ring", "allgather"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default="")
    p.add_argument("--attention", action="store_true", help="the attention kernel alone, one rank, vs SDPA")
    p.add_argument("--portable", action="store_true", help="with --attention: add the unfused path")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, a few seconds")
    args = p.parse_args(argv)
    if args.dry_run:
        attention(256, True, True, 2)
        if not (Path(args.data) / "manifest.json").exists():
            print(f"dry run: no training point ({args.data} is not prepared)")
            return 0
        args.seq, args.cp, args.modes, args.steps, args.dim, args.layers = [128], [1, 2], ["ring"], 1, 32, 1
    elif args.attention:
        for seq in args.seq:
            attention(seq, False, args.portable, args.reps)
        return 0
    if not (Path(args.data) / "manifest.json").exists():
        print(f"{args.data} is not prepared; run `ndtrain prepare --out {args.data} --max-mb 16 --if-absent`")
        return 2
    model = {"preset": "debug", "dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4,
             "ffn_dim": 3 * args.dim}
    rows = []
    for seq in args.seq:
        base = None
        for cp in args.cp:
            for mode in (["ring"] if cp == 1 else args.modes):
                r = point(args.data, seq, cp, mode, model, args.steps)
                base = base or r
                row = (seq, cp, mode if cp > 1 else "-", seq / r["step_s"], r["peak"] / 2**20,
                       base["peak"] / r["peak"], base["step_s"] / r["step_s"], r["cpu_s"] / base["cpu_s"])
                rows.append(row)
                print("seq {:>6}  cp {}  {:>9}  {:>8.0f} tok/s  {:>8.1f} MiB/rank  mem 1/{:.2f}  speed x{:.2f}  "
                      "cpu x{:.2f}".format(*row), flush=True)
    cmd = "python benchmarks/context_parallel.py " + " ".join(argv)
    table = ["| seq_len | cp | attention | tokens/s | peak activations / rank (MiB) | memory vs cp=1 | "
             "speed vs cp=1 | CPU-seconds vs cp=1 |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    table += ["| {} | {} | {} | {:.0f} | {:.1f} | 1/{:.2f} | {:.2f}x | {:.2f}x |".format(*r) for r in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        Path(args.out).write_text(
            f"Model: debug preset with dim={args.dim}, n_layers={args.layers}, 8 heads (4 kv-heads), "
            f"fp32; one sequence per step; torch {torch.__version__}, {os.cpu_count()} CPU cores, Gloo, "
            f"one thread per rank; load average {os.getloadavg()[0]:.1f} when it finished.\n\n"
            f"Command: `{cmd}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
