"""Model-state bytes per rank for DDP and the ZeRO stages at world N, next to the ZeRO paper's
formulas (Rajbhandari et al. 2020).

    .venv/bin/python benchmarks/memory_report.py [--preset tiny] [--world 4]

Rank-local tensor sizes are the honest measure on CPU (RSS mixes in allocator caches). Each
layout trains two steps of two micro-batches; the table is what rank 0 holds across the second
step's micro-batch boundary (after micro-batch 1's backward, before micro-batch 2's forward),
which is where the stages differ: ZeRO-1 and -2 keep the gathered parameters, ZeRO-1 also the
whole (unreduced) gradients; ZeRO-2 and -3 hold only their gradient shard; ZeRO-3 nothing
gathered. Columns: sharded (fp32) parameters, gathered compute copies, gradients (sharded
reduced ones plus unsharded accumulating ones), AdamW state (exp_avg, exp_avg_sq).

Formulas with Ψ parameters, N ranks, K bytes of optimizer state per parameter:
- mixed precision (`mixed_precision = "bf16"`: bf16 compute copies and gradients in the paper,
  fp32 master weights + Adam's two moments = K 12): DDP 16Ψ, ZeRO-1 2Ψ + 2Ψ + 12Ψ/N,
  ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N;
- fp32 (`mixed_precision = "fp32"`: the parameters are the master weights, so K = 8 for the two
  moments; 4-byte gradients): DDP 16Ψ, ZeRO-1 4Ψ + 4Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from common import synthetic_tokens

LAYOUTS = {"DDP": "dp_replicate={w},ga=2", "ZeRO-1": "dp_shard={w},zero=1,ga=2", "ZeRO-2": "dp_shard={w},zero=2,ga=2",
           "ZeRO-3": "dp_shard={w},zero=3,ga=2"}


def _local_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _held(trainer) -> list[float]:
    """[sharded params, gathered compute copies, gradients, AdamW state] bytes on this rank."""
    gathered = unsharded_grads = 0
    for part in trainer.state.model_parts:
        for module in part.modules():
            get = getattr(module, "_get_fsdp_state", None)
            group = get()._fsdp_param_group if get is not None else None
            if group is None:
                continue
            for fp in group.fsdp_params:
                if group.is_unsharded:
                    gathered += fp._orig_size.numel() * fp.param_dtype.itemsize if fp.param_dtype else \
                        fp._orig_size.numel() * fp.sharded_param.element_size()
                acc = fp.unsharded_accumulated_grad
                grad = getattr(fp, "_unsharded_param", None)
                grad = grad.grad if grad is not None else None
                unsharded_grads += _local_bytes(acc) + _local_bytes(grad)
    params = sum(_local_bytes(p) for p in trainer.state.params)
    grads = sum(_local_bytes(p.grad) for p in trainer.state.params) + unsharded_grads
    optim = sum(_local_bytes(v) for s in trainer.state.optimizer.state.values() for k, v in s.items()
                if torch.is_tensor(v) and k != "step")
    return [params, gathered, grads, optim]


def measure(cfgs):
    from ndtrain.train import step as steps
    from ndtrain.train.trainer import Trainer

    out = []
    for cfg in cfgs:
        t = Trainer(cfg, None, log=False)
        seen = []
        loss_sum = steps.loss_sum

        def spy(state, inputs, targets, *rest):  # each micro-batch's forward starts here
            seen.append(_held(t))
            return loss_sum(state, inputs, targets, *rest)

        steps.loss_sum = spy
        try:
            t.train_step()
            t.train_step()
        finally:
            steps.loss_sum = loss_sum
        out.append(torch.tensor(seen[-1], dtype=torch.float64))  # step 2, before micro-batch 2
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
    from ndtrain.tools.verify import layout_config

    shape = preset(a.preset)
    data = synthetic_tokens(Path(tempfile.mkdtemp()) / "data", shape.vocab_size, 400_000)
    psi, n = num_params(shape), a.world
    mib = 2**20
    print(f"{a.preset}: Ψ = {psi:,} parameters, N = {n}; held across a micro-batch boundary on rank 0\n")
    for mp in ("bf16", "fp32"):
        base = {"model": {"preset": a.preset}, "data": {"path": str(data), "seq_len": 128},
                "train": {"global_batch": 2 * a.world}, "parallel": {"mixed_precision": mp}}
        load_config(None, base)
        cfgs = [layout_config(base, spec.format(w=a.world)) for spec in LAYOUTS.values()]
        per_rank = run_ranks(a.world, measure, cfgs, timeout_s=600)
        if mp == "bf16":
            formula = {"DDP": 16 * psi, "ZeRO-1": 4 * psi + 12 * psi / n, "ZeRO-2": 2 * psi + 14 * psi / n,
                       "ZeRO-3": 16 * psi / n}
            text = {"DDP": "16Ψ", "ZeRO-1": "2Ψ + 2Ψ + 12Ψ/N", "ZeRO-2": "2Ψ + 14Ψ/N", "ZeRO-3": "16Ψ/N"}
        else:
            formula = {"DDP": 16 * psi, "ZeRO-1": 8 * psi + 8 * psi / n, "ZeRO-2": 4 * psi + 12 * psi / n,
                       "ZeRO-3": 16 * psi / n}
            text = {"DDP": "16Ψ", "ZeRO-1": "4Ψ + 4Ψ + 8Ψ/N", "ZeRO-2": "4Ψ + 12Ψ/N", "ZeRO-3": "16Ψ/N"}
        print(f"mixed_precision = {mp}\n")
        print("| layout | sharded params | gathered params | gradients | AdamW | total | formula | formula value | measured / formula |")
        print("|---|---|---|---|---|---|---|---|---|")
        for i, name in enumerate(LAYOUTS):
            p, g, gr, o = per_rank[0][i].tolist()
            total = p + g + gr + o
            print(f"| {name} | {p / mib:.2f} MiB | {g / mib:.2f} MiB | {gr / mib:.2f} MiB | {o / mib:.2f} MiB | "
                  f"{total / mib:.2f} MiB | {text[name]} | {formula[name] / mib:.2f} MiB | {total / formula[name]:.3f} |")
        print()


if __name__ == "__main__":
    main()
