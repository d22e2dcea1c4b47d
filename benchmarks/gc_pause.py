"""The pause of Python's garbage collector in the training loop (train.gc_every, docs/launch.md).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gc_pause.py [--preset tiny] [--steps 60]

Builds a Trainer, counts the automatic collections gc.callbacks sees over `--steps` steps (per
generation, with the longest), then times explicit young (generation 1) and full (generation 2)
collections after a step each, first with the whole heap in the collector's sight, then with
what the job built frozen (gc.freeze(), as train/gc_schedule.py does before the loop).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from common import host_header, synthetic_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    print(host_header())
    data = synthetic_tokens(Path(tempfile.gettempdir()) / "ndtrain-gc-pause-tokens", 256)
    cfg = load_config(None, {"model": {"preset": args.preset, "vocab_size": 256},
                             "data": {"path": str(data), "seq_len": 128},
                             "train": {"global_batch": 4, "micro_batch": 4, "val_interval": 0, "sample_tokens": 0,
                                       "steps": 10 * args.steps},
                             "logging": {"tensorboard": False, "progress": "off"}})
    trainer = Trainer(cfg, run_dir=None, log=False)
    for _ in range(3):
        trainer.train_step()
    events, began = [], [0.0]

    def watch(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            events.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(watch)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    per_step = (time.perf_counter() - t0) / args.steps
    gc.callbacks.remove(watch)
    print(f"automatic collections over {args.steps} steps of {per_step * 1e3:.0f} ms: " + ", ".join(
        f"generation {g}: {sum(1 for e in events if e[0] == g)}, longest "
        f"{max([e[1] for e in events if e[0] == g] or [0]) * 1e3:.2f} ms" for g in (0, 1, 2)))
    print(f"objects the collector tracks: {len(gc.get_objects()):,}")

    def timed(generation: int, n: int = 5) -> float:
        took = []
        for _ in range(n):
            trainer.train_step()
            t = time.perf_counter()
            gc.collect(generation)
            took.append(time.perf_counter() - t)
        return statistics.median(took) * 1e3

    print(f"explicit, whole heap: generation 1 {timed(1):.2f} ms, generation 2 {timed(2):.2f} ms (median of 5)")
    gc.collect()
    gc.freeze()
    print(f"explicit, {gc.get_freeze_count():,} objects frozen: generation 1 {timed(1):.2f} ms, "
          f"generation 2 {timed(2):.2f} ms (median of 5)")
    gc.unfreeze()
    trainer.close()


if __name__ == "__main__":
    main()
