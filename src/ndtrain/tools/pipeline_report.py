"""`ndtrain pipeline-report`: see the pipeline bubble.

Measured: run a few training steps of a pipeline layout on local ranks with every stage's
forward/backward/weight-gradient actions timed, draw a Gantt chart (one row per rank, coloured
by action) and print each rank's idle fraction next to the schedule's published bubble.

Simulated (`--simulate`): draw the ideal timeline of any schedule for given (p, v, m) from unit
costs F, B, W, in torch's own action order, with no process group.
"""

from __future__ import annotations

import argparse
import math
import json
import sys
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.layout.schedules import DEFAULT as DEFAULT_SCHEDULE
from ndtrain.paths import check_output_file
from ndtrain.parallel import pipeline_schedule as ps

ACTION_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
LABELS = {"F": "forward (F)", "B": "full backward (B)", "I": "backward to input (I)", "W": "backward to weights (W)"}


# ---- measuring -----------------------------------------------------------------------------

def _measure_rank(cfg, steps: int) -> dict:
    from ndtrain.train.pipeline_trace import trace_steps
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir=None, log=False)
    try:
        return trace_steps(trainer.state, steps)  # {"rank", "stages", "traces", "losses"}
    finally:
        trainer.close()


def timed_actions(cfg, nproc: int, steps: int) -> list[dict]:
    """Train `steps` steps of `cfg` on `nproc` forked ranks; every rank's timed actions per step."""
    from ndtrain.parallel.dims import checked_layout
    from ndtrain.parallel.launch import run_ranks

    dims = checked_layout(cfg.parallel, nproc, cfg.model, cfg.data.seq_len, cfg.train)  # errors before forking
    if dims.pp < 2:
        raise NdtrainError("pipeline-report measures a pipeline: set --parallel.pp to 2 or more")
    return run_ranks(nproc, _measure_rank, cfg, steps, timeout_s=cfg.train.timeout_s)


def step_events(per_rank: list[dict], step: int) -> tuple[list[ps.Event], float, int]:
    """(events of every rank in one step, the step's span, its micro-batch count)."""
    events = [ps.Event(r["rank"], *e) for r in per_rank for e in r["traces"][step]["events"]]
    span = max(r["traces"][step]["end"] for r in per_rank)
    return events, span, per_rank[0]["traces"][step]["m"]


def unit_costs(events: list[ps.Event]) -> dict[str, float]:
    """Mean seconds per stage-chunk and micro-batch: f (loss included), b (whole backward) and w."""
    def total(kinds):
        return sum(e.end - e.start for e in events if e.kind in kinds)

    def count(kinds):
        return len({(e.rank, e.stage, e.mb) for e in events if e.kind in kinds and e.mb >= 0})

    f = total("F") / max(count("F"), 1)
    b = total("BIW") / max(count("BI"), 1)
    w = total("W") / count("W") if count("W") else b / 2
    return {"f": f, "b": b, "w": w}


def _fit_hop(ideal, measured: float, f: float) -> float:
    """The per-hop delay (between a stage's output and its neighbour's start) that makes the ideal
    timeline as idle as the measured one: everything the measurement lost, as one latency."""
    lo, hi = 0.0, max(f, 1e-6)
    if ideal(lo) >= measured:
        return 0.0
    while ideal(hi) < measured and hi < 1e3 * f:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ideal(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def summarize(per_rank: list[dict], schedule: str, p: int, v: int, warmup: int = 1) -> dict:
    """Idle fraction per rank averaged over the steps after `warmup`, next to the schedule's
    published bubble and the ideal bubble of torch's action order for the measured costs."""
    n_steps = len(per_rank[0]["traces"])
    steps = list(range(min(warmup, n_steps - 1), n_steps))
    ranks = [r["rank"] for r in per_rank]
    idle = {r: 0.0 for r in ranks}
    costs = {"f": 0.0, "b": 0.0, "w": 0.0}
    spans, wall, cpu = [], 0.0, 0.0
    for k in steps:
        events, span, m = step_events(per_rank, k)
        spans.append(span)
        for r, x in ps.idle_fractions(events, ranks, span).items():
            idle[r] += x / len(steps)
        for key, x in unit_costs(events).items():
            costs[key] += x / len(steps)
        wall += sum(e.end - e.start for e in events)
        cpu += sum(e.cpu for e in events)
    orders = ps.action_orders(schedule, p, v, m)
    unit = {"F": costs["f"], "B": costs["b"], "I": costs["b"] - costs["w"], "W": costs["w"]}

    def ideal(hop: float) -> float:
        return sum(ps.idle_fractions(ps.simulate(orders, unit, p * v, hop), list(range(p))).values()) / p

    mean_idle = sum(idle.values()) / len(idle)
    return {"schedule": schedule, "p": p, "v": v, "m": m, "steps": steps, "idle": idle,
            "mean_idle": mean_idle, "theory": ps.theoretical_bubble(schedule, p, v, m, **costs),
            "ideal": ideal(0.0), "hop_s": _fit_hop(ideal, mean_idle, costs["f"]), "costs": costs,
            "step_s": sum(spans) / len(spans),
            # Share of the actions' wall time spent waiting for a core (more ranks than cores).
            "core_wait": max(0.0, 1.0 - cpu / wall) if wall > 0 else 0.0,
            "stages": {r["rank"]: r["stages"] for r in per_rank}}


# ---- drawing -------------------------------------------------------------------------------

def draw_gantt(panels: list[dict], path: str | Path) -> Path:
    """panels: [{"title", "events": [Event], "rows": [rank, ...], "row_labels", "unit", "scale", "p"}];
    with "p" (pipeline ranks) a rank's second chunk is drawn lighter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [0.45 * len(pn["rows"]) + 0.9 for pn in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    kinds = set()
    for ax, pn in zip(axes[:, 0], panels):
        row_of = {r: i for i, r in enumerate(pn["rows"])}
        scale = pn.get("scale", 1.0)
        span = max((e.end for e in pn["events"]), default=1.0) * scale
        for e in pn["events"]:
            kinds.add(e.kind)
            y, x0, w = row_of[e.rank], e.start * scale, (e.end - e.start) * scale
            # A rank's later chunks (virtual stages) are drawn lighter than its first.
            alpha = 0.55 if pn.get("p") and (e.stage // pn["p"]) % 2 else 1.0
            ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=ACTION_COLORS[e.kind], edgecolors="white",
                           linewidth=0.4, alpha=alpha)
            if e.mb >= 0 and w > span / 90:
                ax.text(x0 + w / 2, y, str(e.mb), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(pn["rows"])))
        ax.set_yticklabels([pn.get("row_labels", {}).get(r, f"rank {r}") for r in pn["rows"]], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_xlabel(pn.get("unit", "time"), fontsize=8)
        ax.set_title(pn["title"], fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    handles = [Patch(color=ACTION_COLORS[k], label=LABELS[k]) for k in "FBIW" if k in kinds]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measured_panel(per_rank: list[dict], summary: dict, step: int) -> dict:
    events, _, m = step_events(per_rank, step)
    s = summary
    title = (f"{s['schedule']}  p={s['p']} v={s['v']} m={m}: measured idle {s['mean_idle']:.1%} "
             f"(published bubble {s['theory']:.1%}, ideal for measured costs {s['ideal']:.1%})")
    labels = {r: f"rank {r}  stage {','.join(map(str, st))}" for r, st in s["stages"].items()}
    return {"title": title, "events": events, "rows": sorted(s["stages"]), "row_labels": labels,
            "unit": "milliseconds", "scale": 1000.0, "p": s["p"]}


def format_summary(s: dict) -> str:
    lines = [f"{s['schedule']}  p={s['p']} v={s['v']} m={s['m']}  (mean of steps {s['steps'][0] + 1}-"
             f"{s['steps'][-1] + 1}; step {s['step_s'] * 1000:.1f} ms)",
             "rank  stages     idle"]
    for r in sorted(s["idle"]):
        lines.append(f"{r:<5} {','.join(map(str, s['stages'][r])):<10} {s['idle'][r]:6.1%}")
    c = s["costs"]
    lines += [f"measured idle (mean over ranks)      {s['mean_idle']:6.1%}",
              f"published bubble of {s['schedule']:<16} {s['theory']:6.1%}",
              f"ideal for the measured F/B/W         {s['ideal']:6.1%}",
              f"compute time spent waiting for a core {s['core_wait']:5.1%}",
              f"per-hop delay that explains the gap  {s['hop_s'] * 1e3:.2f} ms",
              f"per chunk and micro-batch: F {c['f'] * 1e3:.2f} ms, B {c['b'] * 1e3:.2f} ms, W {c['w'] * 1e3:.2f} ms"]
    return "\n".join(lines)


# ---- the command ---------------------------------------------------------------------------

def _simulate_main(args) -> int:
    names = ps.NAMES if args.schedule == "all" else [s.strip() for s in args.schedule.split(",")]
    panels, rows = [], []
    for name in names:
        if name not in ps.NAMES:
            raise NdtrainError(f"unknown schedule {name!r} (choose from {', '.join(ps.NAMES)} or all)")
        v = args.v if args.v else (2 if name in ps.INTERLEAVED + ps.V_SHAPED else 1)
        problem = ps.virtual_problem(name, v) or ps.microbatch_problem(name, args.pp, v, args.microbatches)
        if problem:
            if args.schedule == "all":
                rows.append(f"{name:<22} {'':>3}  skipped: {problem}")
                continue
            raise NdtrainError(problem)
        r = ps.simulate_schedule(name, args.pp, v, args.microbatches, args.f, args.b, args.w)
        idle = sum(r["idle"].values()) / args.pp
        rows.append(f"{name:<22} {v:>3}  {idle:9.1%}  {r['theory']:9.1%}  {r['makespan']:8.1f}  "
                    f"{max(r['peak_activations'].values()):7.1f}")
        panels.append({"title": f"{name}  p={args.pp} v={v} m={args.microbatches}: ideal idle {idle:.1%}, "
                                f"published {r['theory']:.1%}", "events": r["events"],
                       "rows": list(range(args.pp)), "unit": f"time (F={args.f:g}, B={args.b:g}, W={args.w:g})",
                       "p": args.pp})
    print(f"p={args.pp} m={args.microbatches}  unit costs F={args.f:g} B={args.b:g} (I={args.b - args.w:g} + "
          f"W={args.w:g})")
    print(f"{'schedule':<22} {'v':>3}  {'idle':>9}  {'published':>9}  {'makespan':>8}  {'peak act':>7}")
    print("\n".join(rows))
    print("idle: mean over ranks of the ideal timeline; peak act: most micro-batch activations a rank "
          "holds, in units of one whole-rank micro-batch")
    if args.out and panels:
        print(f"wrote {draw_gantt(panels, args.out)}")
    return 0


def _measure_main(args, overrides: list[str]) -> int:
    from ndtrain.config import load_config

    cfg = load_config(args.config, overrides)
    if args.steps < 2:
        raise NdtrainError("--steps must be >= 2 (the first step warms up and is not counted)")
    per_rank = timed_actions(cfg, args.nproc, args.steps)
    s = summarize(per_rank, cfg.parallel.pp_schedule, cfg.parallel.pp, cfg.parallel.pp_virtual_stages)
    print(format_summary(s))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "ranks": per_rank}, indent=1, default=str))
    if args.out:
        print(f"wrote {draw_gantt([measured_panel(per_rank, s, len(per_rank[0]['traces']) - 1)], args.out)}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain pipeline-report", description=__doc__.split("\n\n")[0],
                                epilog="Measured runs take --section.key=value overrides, e.g. --parallel.pp=4 "
                                       "--parallel.pp_schedule=Interleaved1F1B --parallel.pp_virtual_stages=2")
    p.add_argument("--simulate", action="store_true", help="draw the ideal timeline; no processes are started")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help="simulate: a schedule, a comma list, or 'all'")
    p.add_argument("--pp", type=int, default=4, help="simulate: pipeline ranks")
    p.add_argument("--v", type=int, default=0, help="simulate: stages per rank (default 2 where needed, else 1)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="simulate: micro-batches per step")
    p.add_argument("--f", type=float, default=1.0, help="simulate: forward cost per stage-chunk")
    p.add_argument("--b", type=float, default=2.0, help="simulate: full backward cost (I + W)")
    p.add_argument("--w", type=float, default=1.0, help="simulate: weight-gradient part of the backward")
    p.add_argument("--config", help="measure: TOML config")
    p.add_argument("--nproc", type=int, default=0, help="measure: local ranks to start")
    p.add_argument("--steps", type=int, default=4, help="measure: steps to run (the first is warm-up)")
    p.add_argument("--out", help="write the Gantt chart PNG here")
    p.add_argument("--json", help="measure: write the raw timeline and summary here")
    args, rest = p.parse_known_args(argv)
    for flag, path in (("--out", args.out), ("--json", args.json)):
        if path:
            check_output_file(Path(path), flag)
    if args.simulate:
        if rest:
            raise NdtrainError(f"--simulate takes no config overrides (got {' '.join(rest)})")
        if not 2 <= args.pp <= 64 or not 1 <= args.microbatches <= 1024 or not 0 <= args.v <= 16:
            raise NdtrainError(f"--simulate needs --pp in [2, 64], --microbatches in [1, 1024] and --v in [0, 16] "
                               f"(got {args.pp}, {args.microbatches}, {args.v})")
        if not all(math.isfinite(x) for x in (args.f, args.b, args.w)) or not 0 <= args.w <= args.b or args.f <= 0:
            raise NdtrainError(f"costs need finite F > 0 and 0 <= W <= B (got --f {args.f}, --b {args.b}, --w {args.w})")
        return _simulate_main(args)
    if not 2 <= args.nproc <= 64:
        raise NdtrainError(f"give --nproc N (2 to 64 local ranks) to measure, or --simulate (got --nproc {args.nproc})")
    if args.steps < 2:
        raise NdtrainError(f"--steps must be >= 2 (the first step warms up and is not counted), got {args.steps}")
    return _measure_main(args, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
