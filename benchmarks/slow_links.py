"""Slow links across nodes: the planner's step time against the measured one, per layout, on a
rate-limited link between two nodes; and DiLoCo against per-step sync on the same link.

Two nodes of a cluster in a box (tests/cluster/harness.py: network namespaces on a bridge, needs
root), each node's cable limited by a token bucket (tbf, both directions) to each rate in turn.
Per rate: `ndtrain calibrate --links` across 2 nodes x 2 ranks adds the link between the nodes to
the one-node profile (--profile, or `ndtrain calibrate --quick --worlds 2,4` run first); then the
tiny preset (byte vocabulary, fp32) trains STEPS steps on the stdlib byte corpus under one torchrun
agent per node with

  DDP     dp_replicate=2          2 nodes x 1 rank
  FSDP    dp_shard=2              2 nodes x 1 rank
  HSDP    dp_replicate=2 x dp_shard=2: the replicas across the nodes, the shards within (2 x 2)
  DiLoCo  dp_replicate=2, replicate_sync=diloco, H inner steps (2 nodes x 1 rank)

the layouts interleaved, each repeated --repeats times. Measured: the mean step time after the
warm-up steps: the median for per-step sync (a loaded host adds outliers), and for DiLoCo
((H - 1) x the median inner step + the median step that syncs) / H, the steady state (the last step
syncs too, to end on the averaged weights, so a mean over a short run would over-count syncs); tokens/s
from it; the last step's training loss (the same tokens for every layout). Predicted: planner.api.predict
on the same model, layout, sequence and batch with the calibrated profile (for the 1-rank layouts
the same links with ranks_per_node 1: the section's bandwidth is the node's link); DiLoCo by
planner/diloco.py's step_times on the measured link. Beside each run: the load average and the
cores other processes used during it (/proc/stat less this run's own).

    sudo OMP_NUM_THREADS=1 .venv/bin/python benchmarks/slow_links.py --profile /tmp/sl/base.json \
        --rates 100,1000 --repeats 2 --json /tmp/sl/slow_links.json

The harness is imported from tests/cluster/ (put on sys.path here): one definition of a node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "cluster"), str(ROOT / "benchmarks"), str(ROOT / "src")]

import harness  # noqa: E402
import link_calibration  # noqa: E402
import scenario  # noqa: E402
from common import host_header  # noqa: E402
from planner_vs_measured import busy_seconds, ours_seconds  # noqa: E402

from ndtrain.model.config import preset  # noqa: E402
from ndtrain.planner.api import predict  # noqa: E402
from ndtrain.planner.hardware import this_machine  # noqa: E402

PY = sys.executable
H = 4
LAYOUTS = [("DDP", 1, {"dp_replicate": 2, "dp_shard": 1}),
           ("FSDP", 1, {"dp_shard": 2}),
           ("HSDP", 2, {"dp_replicate": 2, "dp_shard": 2}),
           (f"DiLoCo H={H}", 1, {"dp_replicate": 2, "dp_shard": 1, "replicate_sync": "diloco", "diloco_inner_steps": H})]


def job(args, data: Path, par: dict) -> dict:
    return {"model": {"preset": "tiny", "vocab_size": 256}, "data": {"path": str(data), "seq_len": args.seq},
            "optimizer": {"lr": 1e-3, "warmup_steps": 2},
            "train": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                      "seed": 1234, "val_interval": 0, "sample_tokens": 0},
            "parallel": dict(par), "logging": {"tensorboard": False, "progress": "off"}}


def write_config(path: Path, raw: dict) -> Path:
    from ndtrain.config import load_config, to_toml

    path.write_text(to_toml(load_config(None, raw)))
    return path


def train(args, cluster, key: str, nproc: int, par: dict, run_id: str) -> dict:
    config = write_config(cluster.shared / f"{run_id}.toml", job(args, cluster.shared / "data", par))
    run_dir = cluster.shared / "runs" / run_id
    load = os.getloadavg()[0]
    busy0, ours0, t0 = busy_seconds(), ours_seconds(), time.time()
    codes, started = scenario.train_across(cluster, config, run_dir, nproc, args.timeout, run_id=run_id)
    others = max(0.0, (busy_seconds() - busy0) - (ours_seconds() - ours0)) / (time.time() - t0)
    if set(codes.values()) != {0}:
        raise RuntimeError(f"{key} at {run_id}: exit codes {codes}\n{started.all_logs()}")
    rows = [r for r in scenario.metric_rows(run_dir) if "step_time_s" in r and "event" not in r]
    steps = {r["step"]: r["step_time_s"] for r in rows if r["step"] > args.warmup}
    last = max(rows, key=lambda r: r["step"])
    shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint: ~75 MB a run
    out = {"layout": key, "steps": steps, "loss": last.get("loss"), "load": load, "others_cores": others}
    return {**out, "tokens_per_step": args.global_batch * args.seq,
            **summary(out, args.global_batch * args.seq, last["step"])}


def summary(row: dict, tokens_per_step: int, last_step: int) -> dict:
    """The step time of a run (see the module's docstring) and the tokens/s it gives."""
    steps = {int(k): v for k, v in row["steps"].items()}
    if row["layout"].startswith("DiLoCo"):
        syncs = [t for s, t in steps.items() if s % H == 0 or s == last_step]
        inner = [t for s, t in steps.items() if not (s % H == 0 or s == last_step)]
        step = ((H - 1) * statistics.median(inner) + statistics.median(syncs)) / H
    else:
        step = statistics.median(steps.values())
    return {"step_s": step, "tokens_per_s": tokens_per_step / step}


def predictions(args, profile: Path) -> dict:
    """{layout: predicted seconds per step} from the profile with its measured links."""
    from ndtrain.planner import diloco
    from ndtrain.planner.problem import make_problem

    cfg = preset("tiny", vocab_size=256)
    prof = json.loads(profile.read_text())
    one = profile.with_name(profile.stem + "-1rank.json")
    one.write_text(json.dumps({**prof, "links": {**prof["links"], "ranks_per_node": 1}}))
    out = {}
    for key, nproc, par in LAYOUTS:
        hw = this_machine(str(profile if nproc == 2 else one))
        lay = {k: v for k, v in par.items() if not k.startswith(("replicate_sync", "diloco"))}
        lay.update(micro_batch=args.micro_batch, activation_checkpoint="none")
        pred = predict(cfg, lay, args.seq, args.global_batch, hw, world=2 * nproc, precision="fp32")
        if key.startswith("DiLoCo"):
            pb = make_problem(cfg, args.seq, args.global_batch, 2 * nproc, hw, precision="fp32")
            inner = diloco.replica_prediction(pb, pred.layout)
            link = prof["links"]["inter"]
            rows = diloco.step_times(pb, inner, 2, link["beta"], link["alpha"], [diloco.Variant(H)])
            out[key] = rows[1]["step_s"]
        else:
            out[key] = pred.step_time
    return out


def table(results: list[dict], layouts, warmup: int = 2) -> None:
    """The markdown table of every run, the step times summarised again from each run's steps."""
    for r in results:
        if isinstance(r["steps"], list):  # written before the steps carried their numbers
            r["steps"] = {warmup + 1 + i: t for i, t in enumerate(r["steps"])}
        r.update(summary(r, r.get("tokens_per_step", 512), max(int(k) for k in r["steps"])))
        r["error"] = r["step_s"] / r["predicted_s"] - 1
    print("\n| link | layout | measured s/step (runs) | predicted | error | tokens/s | last loss | load (others' cores) |")
    print("|---|---|---|---|---|---|---|---|")
    for mbit in sorted({r["mbit"] for r in results}):
        for key, *_ in layouts:
            mine = [r for r in results if r["mbit"] == mbit and r["layout"] == key]
            if mine:
                pred = mine[0]["predicted_s"]
                print(f"| {mbit:g} Mbit/s | {key} | " + " / ".join(f"{r['step_s']:.3f}" for r in mine)
                      + f" | {pred:.3f} | " + " / ".join(f"{r['error']:+.0%}" for r in mine) + " | "
                      + " / ".join(f"{r['tokens_per_s']:.0f}" for r in mine) + " | "
                      + " / ".join(f"{r['loss']:.3f}" for r in mine) + " | "
                      + " / ".join(f"{r['load']:.1f} ({r['others_cores']:.2f})" for r in mine) + " |")


def reprice(args, results: list[dict], base: Path) -> None:
    """Each run's predicted_s again, from `base` with the links measured at that run's rate."""
    work = Path("/var/tmp/ndtrain-slow-links")
    work.mkdir(exist_ok=True)
    for mbit in sorted({r["mbit"] for r in results}):
        mine = [r for r in results if r["mbit"] == mbit]
        profile = work / f"repriced-{mbit:g}.json"
        profile.write_text(json.dumps({**json.loads(base.read_text()), "links": mine[0]["links"]}))
        pred = predictions(args, profile)
        for r in mine:
            r["predicted_s"] = pred[r["layout"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", help="the one-node profile (default: run `ndtrain calibrate --quick --worlds 2,4`)")
    p.add_argument("--rates", default="100,1000", help="Mbit/s of each node's link, in turn")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default="", help="comma list of layouts (DDP,FSDP,HSDP,DiLoCo)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2 + 2 * H)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the mean")
    p.add_argument("--timeout", type=float, default=900.0, help="hang guard per run, seconds")
    p.add_argument("--json", help="also write every run here")
    p.add_argument("--table", help="print the table of a --json file written before, run nothing")
    p.add_argument("--reprice", metavar="PROFILE", help="with --table: predict again from this one-node profile "
                   "with each rate's measured links (a calibration taken when the host was quieter)")
    args = p.parse_args()
    if args.table:
        results = json.loads(Path(args.table).read_text())
        if args.reprice:
            reprice(args, results, Path(args.reprice))
        table(results, LAYOUTS, args.warmup)
        return 0
    why = harness.missing_requirements()
    if why:
        p.error(f"a cluster in a box {why}")
    work = Path("/var/tmp/ndtrain-slow-links")
    work.mkdir(exist_ok=True)
    base = Path(args.profile) if args.profile else work / "base.json"
    if not args.profile:
        subprocess.run([PY, "-m", "ndtrain", "calibrate", "--device", "cpu", "--quick", "--worlds", "2,4", "--out",
                        str(base)], cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    layouts = [x for x in LAYOUTS if not args.only or x[0].split()[0] in args.only.split(",")]
    print(host_header(), flush=True)
    from ndtrain.data.prepare import prepare

    results = []
    for mbit in (float(r) for r in args.rates.split(",")):
        with harness.Cluster(2) as cluster:
            prepare(None, cluster.shared / "data", tokenizer="byte", val_fraction=0.05, max_bytes=400_000)
            for node in cluster.nodes:
                node.rate_limit(mbit)
            profile = cluster.shared / "hardware.json"
            shutil.copy(base, profile)
            codes, started = link_calibration.calibrate_links(cluster, 2, profile, args.timeout)
            if set(codes.values()) != {0}:
                raise RuntimeError(f"calibrate --links: {codes}\n{started.all_logs()}")
            links = link_calibration.links_section(profile)
            print(f"\n{mbit:g} Mbit/s: calibrate --links: inter {links['inter']['beta'] * 8 / 1e6:.1f} Mbit/s alpha "
                  f"{links['inter']['alpha'] * 1e6:.0f} us; intra {links['intra']['beta'] * 8 / 1e6:.0f} Mbit/s "
                  f"alpha {links['intra']['alpha'] * 1e6:.0f} us", flush=True)
            pred = predictions(args, profile)
            for rep in range(args.repeats):
                for key, nproc, par in layouts:
                    row = train(args, cluster, key, nproc, par, f"r{int(mbit)}-{rep}-{key.split()[0]}")
                    row.update(mbit=mbit, repeat=rep, predicted_s=pred[key], links=links,
                               error=row["step_s"] / pred[key] - 1)
                    results.append(row)
                    print(f"  {key:<11} rep {rep}: measured {row['step_s']:.3f} s, predicted {pred[key]:.3f} s "
                          f"({row['error']:+.0%}); {row['tokens_per_s']:.0f} tokens/s, loss {row['loss']:.4f}; "
                          f"load {row['load']:.2f}, others {row['others_cores']:.2f} cores", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    table(results, layouts, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
