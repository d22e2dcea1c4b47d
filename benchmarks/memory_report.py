"""Model-state bytes per rank for DDP, ZeRO-2 and ZeRO-3 at world 4, next to the ZeRO formulas.

    .venv/bin/python benchmarks/memory_report.py [--preset tiny] [--world 4]

Rank-local tensor sizes are the honest measure on CPU (RSS mixes in allocator caches): after one
step it sums this rank's parameter shards, gradient shards and AdamW state, and separately the
unsharded (gathered) parameters alive between forward and backward, the part ZeRO-2 keeps.
Formulas (Rajbhandari et al. 2020) for mixed-precision Adam, K = 12: DDP 16Ψ, ZeRO-2
2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N. With fp32 sharded parameters (FSDP2 keeps them fp32 and computes in
bf16), our split is params 4 + grads 4 + Adam 8 = 16 bytes, the same total.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from common import synthetic_tokens

LAYOUTS = {"DDP": "dp_replicate={w},mp=bf16", "ZeRO-2": "dp_shard={w},zero=2,mp=bf16",
           "ZeRO-3": "dp_shard={w},zero=3,mp=bf16"}


def _local_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def measure(cfgs):
    from ndtrain.train.trainer import Trainer

    out = []
    for cfg in cfgs:
        t = Trainer(cfg, None, log=False)
        batch = t.loader.next_batch(cfg.train.global_batch)
        inputs = batch.inputs[: cfg.train.micro_batch]
        logits = t.model(inputs)  # forward only: what is still gathered now is held until backward
        gathered = 0
        for m in t.model.modules():
            state = getattr(m, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state is not None else None
            if group is not None and group.is_unsharded:
                gathered += sum(p._orig_size.numel() * 2 for p in group.fsdp_params)  # bf16 copies
        logits.float().sum().backward()
        t.optimizer.step()
        params = sum(_local_bytes(p) for p in t.params)
        grads = sum(_local_bytes(p.grad) for p in t.params)
        optim = sum(_local_bytes(v) for s in t.optimizer.state.values() for k, v in s.items()
                    if torch.is_tensor(v) and k != "step")
        out.append(torch.tensor([params, grads, optim, gathered], dtype=torch.float64))
        t.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    from ndtrain.config import load_config
    from ndtrain.model.config import num_params, preset
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.parallel.verify import layout_config

    shape = preset(a.preset)
    data = synthetic_tokens(Path(tempfile.mkdtemp()) / "data", shape.vocab_size, 400_000)
    base = {"model": {"preset": a.preset}, "data": {"path": str(data), "seq_len": 128},
            "train": {"global_batch": a.world, "micro_batch": 1}}
    load_config(None, base)
    cfgs = [layout_config(base, spec.format(w=a.world)) for spec in LAYOUTS.values()]
    per_rank = run_ranks(a.world, measure, cfgs, timeout_s=600)
    psi, n = num_params(shape), a.world
    formula = {"DDP": 16 * psi, "ZeRO-2": 2 * psi + 14 * psi / n, "ZeRO-3": 16 * psi / n}
    mib = 2**20
    print(f"{a.preset}: Ψ = {psi:,} parameters, N = {n}\n")
    print("| layout | params | grads | AdamW | model state (rank 0) | + gathered bf16 params (fwd→bwd) | formula | measured / formula |")
    print("|---|---|---|---|---|---|---|---|")
    for i, name in enumerate(LAYOUTS):
        p, g, o, gathered = per_rank[0][i].tolist()
        state = p + g + o
        total = state + (gathered if name == "ZeRO-2" else 0)
        print(f"| {name} | {p / mib:.1f} MiB | {g / mib:.1f} MiB | {o / mib:.1f} MiB | {state / mib:.1f} MiB | "
              f"{gathered / mib:.1f} MiB | {formula[name] / mib:.1f} MiB | {total / formula[name]:.3f} |")
    print("\nZeRO-2's measured column adds the gathered bf16 parameters it keeps from forward to backward.")


if __name__ == "__main__":
    main()
