"""DiLoCo vs per-step sync on the default corpus: validation loss after the same number of tokens,
and the bytes each rank sends across replicas, measured.

Every variant trains the `tiny` preset from the same initial weights on the same sample stream
(2 replicas; and 2 replicas x dp_shard=2), for the same steps and global batch, then validates on
the same held-out samples. Bytes: every torch.distributed all_reduce / reduce_scatter_tensor /
all_gather_into_tensor / broadcast issued during the training steps on a group spanning more than
one replica is counted (its input tensor's bytes, per rank); under per-step sync that is HSDP's
gradient all-reduce (plus the trainer's scalars), under DiLoCo the outer all-reduce and the flags.
DiLoCo's own counter (metrics `cross_replica_bytes`) is checked against it.

    make data
    OMP_NUM_THREADS=1 nice python benchmarks/diloco.py --steps 256 --seq 128 --layouts "2 replicas" --out d.json
    OMP_NUM_THREADS=1 nice python benchmarks/diloco.py --steps 256 --seq 128 --layouts "2 replicas" --out d.json \
        --variants "DiLoCo H=8 lr=0.7 mu=0.9,DiLoCo H=8 lr=0.7 mu=0.5,DiLoCo H=8 lr=1 mu=0.5,DiLoCo H=32 lr=0.7 mu=0.9"
    OMP_NUM_THREADS=1 nice python benchmarks/diloco.py --steps 256 --seq 128 --layouts "2 replicas x dp_shard=2" \
        --variants "per-step sync,DiLoCo H=8,DiLoCo H=32" --out d.json

Step times are recorded but mean little here: the "network" is loopback on a shared 2-core host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

def _diloco(h: int, lr: float | None = None, mu: float | None = None, fragments: int = 1, overlap: int = 0) -> dict:
    out = {"replicate_sync": "diloco", "diloco_inner_steps": h, "diloco_fragments": fragments,
           "diloco_overlap_steps": overlap}
    if lr is not None:  # else --outer-lr / --outer-momentum
        out.update(diloco_outer_lr=lr, diloco_outer_momentum=mu)
    return out


VARIANTS = {
    "per-step sync": {},
    "DiLoCo H=8": _diloco(8),
    "DiLoCo H=32": _diloco(32),
    "streaming H=32 F=4 overlap=1": _diloco(32, fragments=4, overlap=1),
    # Other outer-optimizer settings side by side (the paper's lr 0.7, Nesterov 0.9 among them).
    "DiLoCo H=8 lr=0.7 mu=0.9": _diloco(8, 0.7, 0.9),
    "DiLoCo H=8 lr=0.7 mu=0.5": _diloco(8, 0.7, 0.5),
    "DiLoCo H=8 lr=1 mu=0.5": _diloco(8, 1.0, 0.5),
    "DiLoCo H=32 lr=0.7 mu=0.9": _diloco(32, 0.7, 0.9),
    "streaming H=32 F=4 overlap=1 lr=0.7 mu=0.9": _diloco(32, 0.7, 0.9, 4, 1),
}
DEFAULT_VARIANTS = ["per-step sync", "DiLoCo H=8", "DiLoCo H=32", "streaming H=32 F=4 overlap=1"]
LAYOUTS = {"2 replicas": (2, {"dp_replicate": 2, "dp_shard": 1}),
           "2 replicas x dp_shard=2": (4, {"dp_replicate": 2, "dp_shard": 2})}
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")


def job(args, parallel: dict) -> dict:
    # The tiny preset as `make train` runs it (configs/default.toml): byte vocabulary, ~6.4M parameters.
    return {"model": {"preset": "tiny", "vocab_size": 256}, "data": {"path": args.data, "seq_len": args.seq},
            "optimizer": {"lr": args.lr, "warmup_steps": args.warmup},
            "train": {"steps": args.steps, "global_batch": args.batch, "micro_batch": args.batch, "seed": args.seed,
                      "val_batches": args.val_batches},
            "parallel": {"diloco_outer_lr": args.outer_lr, "diloco_outer_momentum": args.outer_momentum, **parallel},
            "logging": {"tensorboard": False, "progress": "off"}}


class CrossReplicaMeter:
    """Counts the bytes of collectives on groups that span replicas (wraps torch.distributed)."""

    def __init__(self, replicas_of: dict[int, int]):
        import torch.distributed as dist

        self.dist, self.replica_of, self.bytes, self.on = dist, replicas_of, 0, False
        self._spans: dict = {}
        self._saved = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in self._saved.items():
            setattr(dist, name, self._wrap(name, fn))

    def _crosses(self, group) -> bool:
        key = id(group)
        if key not in self._spans:
            ranks = self.dist.get_process_group_ranks(group) if group is not None else list(self.replica_of)
            self._spans[key] = len({self.replica_of[r] for r in ranks}) > 1
        return self._spans[key]

    def _wrap(self, name: str, fn):
        # (keyword, position) of the tensor sent and of the group, per collective
        where = {"all_reduce": ("tensor", 0, 2), "broadcast": ("tensor", 0, 2),
                 "reduce_scatter_tensor": ("input", 1, 3), "all_gather_into_tensor": ("input_tensor", 1, 2)}[name]

        def counted(*a, **k):
            if self.on:
                key, pos, gpos = where
                tensor = k[key] if key in k else a[pos]
                group = k["group"] if "group" in k else (a[gpos] if len(a) > gpos else None)
                if self._crosses(group):
                    self.bytes += tensor.numel() * tensor.element_size()
            return fn(*a, **k)
        return counted

    def close(self) -> None:
        for name, fn in self._saved.items():
            setattr(self.dist, name, fn)


def run_variants(cfgs: list[dict]) -> list[dict]:
    """Rank fn: each config in turn, in this process group."""
    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    out = []
    for raw in cfgs:
        cfg = load_config(None, raw)
        torch.manual_seed(0)
        t = Trainer(cfg, None, log=False)
        d = t.state.layout
        per_replica = d.dp_shard * d.cp * d.tp
        meter = CrossReplicaMeter({r: (r // per_replica) % d.dp_replicate for r in range(d.world)})
        times, own, losses, outer = [], 0, [], []
        for _ in range(cfg.train.steps):
            meter.on = True
            r = t.train_step()
            meter.on = False
            times.append(r.seconds)
            losses.append(r.loss)
            own += r.extra.get("cross_replica_bytes", 0)
            outer += r.rows  # DiLoCo's outer steps (none for other layouts)
        meter.close()
        val = t.validation_loss()
        out.append({"val_loss": val, "train_loss_last10": statistics.mean(losses[-10:]),
                    "bytes_per_step": meter.bytes / cfg.train.steps, "own_bytes_per_step": own / cfg.train.steps,
                    "step_s_median": statistics.median(times[3:] or times), "outer_steps": len(outer),
                    "sync_s_median": statistics.median([o["sync_s"] for o in outer]) if outer else 0.0,
                    "sync_s_total": sum(o["sync_s"] for o in outer),
                    "params": sum(p.numel() for p in t.state.params), "outer_lr": cfg.parallel.diloco_outer_lr,
                    "outer_momentum": cfg.parallel.diloco_outer_momentum})
        t.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="initial weights and sample order")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=15)
    # The config defaults (measured best here: see docs/results/benchmarks.md)
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--outer-momentum", type=float, default=0.0)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from: {', '.join(VARIANTS)}")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    from ndtrain.parallel.launch import run_ranks

    # --out accumulates: runs of earlier invocations (other layouts or variants) are kept.
    results = json.loads(Path(a.out).read_text()) if a.out and Path(a.out).exists() else {"runs": {}}
    results.setdefault("invocations", []).append({"args": vars(a), "load_avg_before": os.getloadavg()})
    names = [v for v in VARIANTS if v in a.variants.split(",")]
    for layout in a.layouts.split(","):
        world, par = LAYOUTS[layout]
        t0 = time.time()
        ranks = run_ranks(world, run_variants, [job(a, {**par, **VARIANTS[v]}) for v in names], timeout_s=600)
        results["runs"].setdefault(layout, {}).update(zip(names, ranks[0]))
        print(f"{layout}: {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
    results["invocations"][-1]["load_avg_after"] = os.getloadavg()
    tokens = a.steps * a.batch * a.seq
    print(f"\ntiny preset, {a.steps} steps x {a.batch} x {a.seq} tokens = {tokens:,} tokens; inner lr {a.lr}, "
          f"outer lr {a.outer_lr}, outer momentum {a.outer_momentum}")
    print("| layout | variant | outer lr, momentum | val loss | vs per-step sync | bytes across replicas / step | "
          "ratio | outer steps | step s (median) | blocked in outer syncs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout, runs in results["runs"].items():
        ref = runs.get("per-step sync")
        for name in [v for v in VARIANTS if v in runs]:
            r = runs[name]
            rel = f"{(r['val_loss'] / ref['val_loss'] - 1) * 100:+.2f}%" if ref else "-"
            ratio = f"{ref['bytes_per_step'] / r['bytes_per_step']:.1f}x fewer" if ref and name != "per-step sync" else "-"
            outer = "-" if name == "per-step sync" else f"{r['outer_lr']:g}, {r['outer_momentum']:g}"
            print(f"| {layout} | {name} | {outer} | {r['val_loss']:.4f} | {rel} | {r['bytes_per_step'] / 1e6:.3f} MB | "
                  f"{ratio} | {r['outer_steps']} | {r['step_s_median']:.2f} | {r['sync_s_total']:.2f} s |")
            if name != "per-step sync":  # DiLoCo's own counter must agree with what was measured
                assert abs(r["own_bytes_per_step"] - r["bytes_per_step"]) <= 1e-6 * r["bytes_per_step"], r
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
