"""Fixed global batches against batch_ramp = "auto" at one token budget (docs/batch-size.md).

    python benchmarks/batch_size.py --out runs/batch-size --budget 196608 --seq 128 \
        fixed:8 fixed:16 fixed:32 fixed:64 auto:8:64

Each run is configs/default.toml (tiny) with a constant learning rate after its warmup (a cosine
needs the number of steps, which "auto" does not know in advance), stopped at the first step whose
tokens reach the budget; that step is the run's last, so it validates there. Prints one JSON line
per run: steps, tokens, final validation loss, the batches it used."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ndtrain.config import load_config
from ndtrain.train import step as step_mod
from ndtrain.train.trainer import train


def run(spec: str, out: Path, budget: int, seq: int, ckpt_every: int) -> dict:
    kind, *sizes = spec.split(":")
    gb = int(sizes[0])
    train_keys = {"steps": 10**6, "time_budget_s": 0, "global_batch": gb, "micro_batch": min(gb, 8),
                  "val_interval": 10**9, "val_batches": 8, "sample_tokens": 0, "output_dir": str(out / spec.replace(":", "-")),
                  "overwrite": True}
    if kind == "auto":
        train_keys.update(batch_ramp="auto", batch_auto_max=int(sizes[1]), micro_batch=min(gb, 4))
    cfg = load_config("configs/default.toml", {"data": {"seq_len": seq}, "train": train_keys,
                                               "optimizer": {"schedule": "constant", "batch_lr_rule": "sqrt"},
                                               "checkpoint": {"interval_steps": ckpt_every, "keep_last": 1},
                                               "logging": {"tensorboard": False, "progress": "off"}})
    original = step_mod.train_step

    def until_budget(state, batch, data_wait_s=0.0):
        result = original(state, batch, data_wait_s)
        if state.progress.tokens_seen >= budget:
            state.cfg.train.steps = state.progress.step  # the loop's last step: validate, save, stop
        return result

    step_mod.train_step = until_budget
    try:
        summary = train(cfg)
    finally:
        step_mod.train_step = original
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    return {"run": spec, "steps": summary["steps"], "tokens": steps[-1]["tokens_seen"], "val_loss": summary["val_loss"],
            "batches": sorted({r["global_batch"] for r in steps}),
            "noise_scale_last": steps[-1].get("grad_noise_scale"),
            "seconds": sum(r["step_time_s"] for r in steps)}


def plot(out: Path, specs: list[str], path: Path) -> None:
    """Training loss against tokens for every run, and the auto runs' batch and noise scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for spec in specs:
        rows = [json.loads(x) for x in (out / spec.replace(":", "-") / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r]
        a.plot([r["tokens_seen"] for r in rows], [r["loss"] for r in rows], lw=1, label=spec)
        if spec.startswith("auto"):
            b.step([r["step"] for r in rows], [r["global_batch"] for r in rows], where="post", label=f"{spec}: batch")
            pts = [(r["step"], r["grad_noise_scale"]) for r in rows if "grad_noise_scale" in r]
            b.plot(*zip(*pts), ls=":", label=f"{spec}: gradient noise scale")
    a.set(xlabel="tokens seen", ylabel="training loss", ylim=(None, 4.0))
    b.set(xlabel="step", ylabel="sequences", yscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", type=Path, default=Path("runs/batch-size"))
    p.add_argument("--budget", type=int, default=196_608)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--ckpt-every", type=int, default=16)
    p.add_argument("--plot", type=Path, help="write the figure here")
    p.add_argument("--plot-only", action="store_true", help="draw the runs already in --out")
    args = p.parse_args()
    for spec in [] if args.plot_only else args.runs:
        print(json.dumps(run(spec, args.out, args.budget, args.seq, args.ckpt_every)), flush=True)
    if args.plot:
        plot(args.out, args.runs, args.plot)


if __name__ == "__main__":
    main()
