"""Time to first step: from forking the ranks to the end of the first optimizer step, for two
source trees side by side (e.g. before and after a change to how the mesh is built).

    .venv/bin/python benchmarks/startup.py --before /tmp/ndtrain-before/src [--passes 3]

`--before` is the `src` folder of another checkout (e.g. `git archive <commit> src | tar -x -C
/tmp/ndtrain-before`); the other tree is this checkout's. Each trial is a fresh Python process
(PYTHONPATH selects the tree) that forks the ranks with ndtrain.parallel.launch.run_ranks, builds
the Trainer and takes one step: world 4 (dp_shard 2 x tp 2) and world 8 (pp 2 x dp_shard 2 x tp 2),
debug model, synthetic tokens. Trees and worlds alternate within each pass, and the load average
is printed before each trial: the machine is shared and the numbers move with it. Reported: the
median over passes of the time to first step, of the time spent building the mesh (the slowest
rank, timed after a barrier so that it excludes waiting for the other ranks to start), and the number of process groups created (`new_group` calls on each rank, mesh and
pipeline together).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {4: {"dp_shard": 2, "tp": 2}, 8: {"pp": 2, "dp_shard": 2, "tp": 2}}


def _rank(cfg_dict: dict) -> dict:
    import torch.distributed.distributed_c10d as c10d

    from ndtrain.config import load_config
    from ndtrain.parallel import dims as pdims

    groups = [0]
    new_group = c10d._new_group_with_tag

    def counting(*args, **kwargs):
        groups[0] += 1
        return new_group(*args, **kwargs)

    c10d._new_group_with_tag = counting
    mesh_s = [0.0]
    build = pdims.build_mesh

    def timed(*args, **kwargs):
        import torch.distributed as dist

        dist.barrier()  # the first collective also waits for the slowest rank to start: not the mesh's cost
        t = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            mesh_s[0] += time.perf_counter() - t

    pdims.build_mesh = timed
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, cfg_dict), run_dir=None, log=False)
    trainer.train_step()
    done = time.time()
    trainer.close()
    return {"done": done, "mesh_s": mesh_s[0], "groups": groups[0]}


def child(world: int, data: str) -> None:
    from ndtrain.parallel.launch import run_ranks

    cfg = {"model": {"preset": "debug"}, "data": {"path": data, "seq_len": 64},
           "train": {"global_batch": 8, "micro_batch": 2, "seed": 1, "steps": 1},
           "logging": {"tensorboard": False, "progress": "off"}, "parallel": LAYOUTS[world]}
    t0 = time.time()
    out = run_ranks(world, _rank, cfg, timeout_s=600)
    print(json.dumps({"first_step_s": max(r["done"] for r in out) - t0, "mesh_s": max(r["mesh_s"] for r in out),
                      "groups": max(r["groups"] for r in out)}))


def trial(tree: Path, world: int, data: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", str(world), "--data", data], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} world {world} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="the src folder of the tree to compare against")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.data)
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import synthetic_tokens

    data = str(synthetic_tokens(Path(tempfile.gettempdir()) / "ndtrain-startup-tokens", vocab=256, num_tokens=200_000))
    trees = {"before": args.before.resolve(), "after": ROOT / "src"}
    results: dict[tuple[str, int], list[dict]] = {}
    loads = []
    for i in range(args.passes):
        for world in LAYOUTS:
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                load = os.getloadavg()[0]
                loads.append(load)
                r = trial(trees[name], world, data)
                results.setdefault((name, world), []).append(r)
                print(f"pass {i + 1} world {world} {name:6s}: first step {r['first_step_s']:6.2f} s, mesh "
                      f"{r['mesh_s']:5.2f} s, {r['groups']} groups (load {load:.1f})", flush=True)
    print(f"\nload average (1 min) during the run: {min(loads):.1f} - {max(loads):.1f}; {os.cpu_count()} cores")
    print("| world (layout) | tree | time to first step (s) | mesh build (s) | new_group calls per rank |")
    print("|---|---|---|---|---|")
    for world, lay in LAYOUTS.items():
        desc = " x ".join(f"{k} {v}" for k, v in lay.items())
        for name in trees:
            rs = results[(name, world)]
            print(f"| {world} ({desc}) | {name} | {statistics.median(r['first_step_s'] for r in rs):.2f} | "
                  f"{statistics.median(r['mesh_s'] for r in rs):.2f} | {rs[0]['groups']} |")
        before, after = (statistics.median(r["first_step_s"] for r in results[(n, world)]) for n in trees)
        print(f"| {world} | after / before | {after / before:.2f} | | |")


if __name__ == "__main__":
    main()
