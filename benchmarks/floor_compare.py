"""ndtrain vs the plain-PyTorch FSDP2 floor, side by side, alternating, in one run.

    .venv/bin/python benchmarks/floor_compare.py [--passes 2] [--steps 25]

Same model shape (the peers' debugmodel: 6.2M parameters), uniform random tokens, seq 256,
micro-batch 4 per rank, fp32 AdamW, world 1 (2 threads) and world 2 (FSDP, 1 thread per rank).
Prints tokens/s of both and the ratio ndtrain/floor per world size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import PEER_MODEL, PY, model_overrides, ndtrain_step_time, run, synthetic_tokens, torchrun


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--worlds", default="1,2")
    a = ap.parse_args()
    seq, mb = 256, 4
    tmp = Path(tempfile.mkdtemp(prefix="ndtrain-floor-"))
    data = synthetic_tokens(tmp / "data", PEER_MODEL["vocab_size"])
    results: dict[tuple[str, int], list[float]] = {}
    for world in [int(w) for w in a.worlds.split(",")]:
        env = {"OMP_NUM_THREADS": "2" if world == 1 else "1"}
        for i in range(a.passes):
            floor_cmd = ([PY] if world == 1 else torchrun(world)) + [
                "benchmarks/fsdp_floor.py", f"--steps={a.steps}", f"--warmup={a.warmup}", f"--mb={mb}", f"--seq={seq}"]
            floor = json.loads(run(floor_cmd, env).strip().splitlines()[-1])
            results.setdefault(("floor", world), []).append(floor["tokens_per_s"])
            run_dir = tmp / f"nd-w{world}-{i}"
            nd_cmd = ([PY, "-m", "ndtrain", "train"] if world == 1 else [PY, "-m", "ndtrain", "train", f"--nproc={world}"]) + [
                *model_overrides(PEER_MODEL), f"--data.path={data}", f"--data.seq_len={seq}",
                f"--train.global_batch={mb * world}", f"--train.micro_batch={mb}", f"--train.steps={a.steps}",
                "--train.val_interval=0", "--train.sample_tokens=0", "--optimizer.lr=1e-3", "--optimizer.warmup_steps=0",
                "--optimizer.weight_decay=0.1", f"--train.output_dir={run_dir}", "--logging.tensorboard=false",
                "--logging.progress=off", "--parallel.dp_shard=-1"]
            run(nd_cmd, env)
            step = ndtrain_step_time(run_dir, a.warmup)
            results.setdefault(("ndtrain", world), []).append(mb * seq * world / step)
            print(f"world {world} pass {i + 1}: floor {floor['tokens_per_s']:,.0f} tok/s, "
                  f"ndtrain {results[('ndtrain', world)][-1]:,.0f} tok/s", flush=True)
    print("\n| world | floor tokens/s | ndtrain tokens/s | ndtrain / floor |\n|---|---|---|---|")
    for world in sorted({w for _, w in results}):
        f = statistics.median(results[("floor", world)])
        n = statistics.median(results[("ndtrain", world)])
        print(f"| {world} | {f:,.0f} | {n:,.0f} | {n / f:.2f} |")


if __name__ == "__main__":
    main()
