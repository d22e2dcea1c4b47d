"""`ndtrain train`: run in this process, under torchrun, or launch N local processes."""

from __future__ import annotations

import argparse
import os
import sys

from ndtrain.config import load_config
from ndtrain.errors import NdtrainError


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch_local(nproc: int, max_restarts: int, argv: list[str]) -> int:
    """Start `nproc` workers through torch.distributed.run (what torchrun does), on one host."""
    from torch.distributed.run import main as torchrun_main

    # Restarted workers that reuse the agent's shared rendezvous store sometimes see stale
    # connections; a store per attempt makes restarts reliable.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "-m", "ndtrain", "train", *argv]
    try:
        torchrun_main(args)
    except SystemExit as exc:  # torchrun exits via SystemExit on some paths
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: the workers already printed their tracebacks
        print(f"ndtrain train: workers failed: {type(exc).__name__}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str], plan=None) -> int:
    """`plan`: the `[parallel] auto` planner (ndtrain.tools.auto hands it in; see trainer.plan_layout)."""
    p = argparse.ArgumentParser(prog="ndtrain train", description="Train a model.",
                                epilog="Any --section.key=value overrides the config file.")
    p.add_argument("--config", help="TOML config (default: built-in debug defaults)")
    p.add_argument("--nproc", type=int, default=0, help="launch N local processes (torchrun)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the group after a crash or hang, up to K times, from the last checkpoint")
    args, overrides = p.parse_known_args(argv)
    cfg = load_config(args.config, overrides)  # fails here, before any process starts
    from ndtrain.train.trackers import check_installed

    check_installed(cfg.logging)

    if args.nproc and not _under_launcher():
        if args.nproc < 1:
            raise NdtrainError("--nproc must be >= 1")
        from ndtrain.parallel.dims import resolve
        from ndtrain.train.recovery import check_global_batch
        from ndtrain.train.trainer import default_run_dir, plan_layout

        plan_layout(cfg, args.nproc, plan)  # workers plan again for themselves; this surfaces errors now
        dims = resolve(cfg.parallel, args.nproc, cfg.model, cfg.data.seq_len, cfg.train,
                       cfg.data)  # errors before spawning
        check_global_batch(cfg, dims.dp)
        # One run directory for every rank and every restart attempt.
        forwarded = [a for a in argv]
        for flag in ("--nproc", "--max-restarts"):
            forwarded = _drop_flag(forwarded, flag)
        if not cfg.train.output_dir:
            forwarded.append(f"--train.output_dir={default_run_dir(cfg)}")
        return launch_local(args.nproc, args.max_restarts, forwarded)

    from ndtrain.train.trainer import train

    summary = train(cfg, plan=plan)
    if summary.get("preempted"):
        from ndtrain.train.recovery import EXIT_PREEMPTED

        return EXIT_PREEMPTED  # saved and stopped on a signal: nonzero so schedulers run it again
    return 0


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out
