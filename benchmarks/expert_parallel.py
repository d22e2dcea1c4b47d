"""Expert parallel: all-to-all volume per step for ep = 2 and 4, measured next to the analytic
count. (Step times are left out: on this shared 2-core host they vary by 2x between repeats of
the same tiny layout, far more than the exchange costs.)

Measured: bytes of token rows each rank sends to *other* ranks through the expert all-to-alls
(parallel/expert.py's TrafficMeter, which sees forward, backward and recompute), summed over
ranks. Analytic, for routing spread evenly over experts:

    passes x L_moe x tokens x k x (1 - dropped) x (ep - 1)/ep x dim x bytes

passes = 4 (dispatch + combine, forward + backward; 6 with full recompute), tokens = the
step's global tokens, dropped = the measured dropped-assignment fraction. The ratio
measured/analytic is then the routing's deviation from uniform. The token-count exchange
(n_experts int64 per layer and micro-batch) is listed separately.

    python benchmarks/expert_parallel.py --out docs/benchmarks_moe.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from ndtrain.config import load_config  # noqa: E402


def job(data: str, world: int, ep: int, seq: int, per_rank: int, model: dict, ac: str):
    return load_config(None, {
        "model": {"preset": "debug-moe", **model},
        "data": {"path": data, "seq_len": seq},
        "optimizer": {"warmup_steps": 0, "schedule": "constant"},
        "train": {"global_batch": per_rank * world, "micro_batch": per_rank, "seed": 0},
        "parallel": {"dp_shard": world, "ep": ep, "activation_checkpoint": ac},
        "logging": {"tensorboard": False, "progress": "off"}})


def measure(cfg, steps: int) -> dict:
    from ndtrain.parallel.expert import traffic_meter
    from ndtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(cfg, run_dir=None, log=False)
    meter = traffic_meter(trainer.state.model)
    sent, dropped, extra = [], [], {}
    for i in range(steps + 1):
        before = meter.bytes_sent if meter else 0
        r = trainer.train_step()
        if i:  # the first step warms up
            sent.append((meter.bytes_sent if meter else 0) - before)
            dropped.append(r.extra.get("moe/dropped_frac", 0.0))
            extra = r.extra
    trainer.close()
    return {"sent": sent, "dropped": sum(dropped) / len(dropped),
            "imbalance": extra.get("moe/imbalance", 1.0)}


def analytic(cfg, ep: int, dropped: float, recompute: bool) -> float:
    m = cfg.model
    layers = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    tokens = cfg.train.global_batch * cfg.data.seq_len
    passes = 6 if recompute else 4
    return passes * layers * tokens * m.n_active_experts * (1 - dropped) * (ep - 1) / ep * m.dim * 4


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/stdlib-byte")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--per-rank", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    from ndtrain.parallel.launch import run_ranks

    cases = [  # (label, world, ep, model overrides, activation checkpointing)
        ("ep=2", 2, 2, {}, "none"),
        ("ep=2, capacity 1.0", 2, 2, {"capacity_factor": 1.0}, "none"),
        ("ep=2, full recompute", 2, 2, {}, "full"),
        ("ep=4", 4, 4, {}, "none"),
        ("ep=2 x 2 expert shards", 4, 2, {}, "none"),
    ]
    rows = []
    for label, world, ep, model, ac in cases:
        cfg = job(args.data, world, ep, args.seq, args.per_rank, model, ac)
        per_rank = run_ranks(world, measure, cfg, args.steps, timeout_s=600)
        measured = sum(sum(r["sent"]) for r in per_rank) / args.steps
        expect = analytic(cfg, ep, per_rank[0]["dropped"], ac == "full")
        rows.append((label, world, measured / 2**20, expect / 2**20, measured / expect, per_rank[0]["imbalance"],
                     per_rank[0]["dropped"]))
        print(rows[-1], flush=True)

    m = job(args.data, 2, 2, args.seq, args.per_rank, {}, "none").model
    counts_kb = m.n_experts * 8 / 1024
    lines = [
        "## Expert parallel: all-to-all volume per step",
        "",
        f"`debug-moe` (dim {m.dim}, {m.n_experts} experts, top-{m.n_active_experts}, "
        f"{sum(m.is_moe_layer(i) for i in range(m.n_layers))} MoE layers), seq {args.seq}, "
        f"{args.per_rank} sequences per rank per step, fp32, Gloo on CPU; "
        f"mean of {args.steps} steps after one warm-up.",
        "Volume = token rows sent to other ranks, summed over ranks (forward + backward, + recompute).",
        "",
        "| layout | world | measured MiB/step | analytic MiB/step (uniform routing) | measured / analytic "
        "| max/mean expert load (last step, worst layer) | dropped |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, world, meas, exp, ratio, imb, drop in rows:
        lines.append(f"| {label} | {world} | {meas:.2f} | {exp:.2f} | {ratio:.3f} | {imb:.2f} | {drop:.3f} |")
    lines += [
        "",
        "Analytic: passes x L_moe x tokens x k x (1 - dropped) x (ep-1)/ep x dim x 4 bytes, passes = 4 "
        "(dispatch + combine, forward + backward) or 6 with full recompute (the forward's two "
        "all-to-alls run again in backward). The (ep-1)/ep term holds for any expert load, not only "
        "a balanced one: the tokens an expert receives come from all ep ranks' i.i.d. data, so 1/ep "
        "of them are already on the expert's own rank, up to sampling noise. Dropped assignments are "
        "never sent (dropped = mean dropped fraction of the measured steps).",
        "",
        f"Plus the token-count exchange: {counts_kb:.3f} KiB per MoE layer and micro-batch per rank "
        "(forward only; again under recompute).",
        "",
        "Command: `python benchmarks/expert_parallel.py " + " ".join(argv) + "`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
