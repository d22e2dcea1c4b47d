"""The report's figures, one function each: runs in, a PNG out (or None when no run has the
data). Several runs share every axis, one colour per run, so layouts or precisions compare."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ndtrain.tools.run_data import Run, membership_phases, tokens_at, world_over_time  # noqa: E402

COLORS = plt.get_cmap("tab10").colors
MARKS = {  # event -> (colour, label) on the timeline
    "checkpoint": ("#2ca02c", "checkpoint saved"),
    "restart": ("#d62728", "restart"),
    "resume": ("#1f77b4", "resumed (a new ndtrain train)"),
    "rollback": ("#ff7f0e", "rolled back"),
    "skipped": ("#9467bd", "skipped step (non-finite)"),
    "skip_window": ("#8c564b", "data window skipped"),
    "straggler": ("#e377c2", "straggler named"),
}


def _color(i: int):
    return COLORS[i % len(COLORS)]


def _save(fig, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # steps and ranks are whole numbers
        if ax.get_xlabel().startswith("step"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_ylabel() == "step":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _series(rows: list[dict], x: str, y: str) -> tuple[list, list]:
    pts = [(r[x], r[y]) for r in rows if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _legend(ax, runs: list[Run]) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def loss(runs: list[Run], path: Path) -> Path | None:
    if not any(r.train for r in runs):
        return None
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, run in enumerate(runs):
        xs, ys = _series(run.train, "tokens_seen", "loss")
        ax.plot(xs, ys, color=_color(i), lw=1.2, alpha=0.85, label=f"{run.label}: training")
        vx = [tokens_at(run, v["step"]) for v in run.val]
        pts = [(x, v["val_loss"]) for x, v in zip(vx, run.val) if x is not None]
        if pts:
            ax.plot(*zip(*pts), color=_color(i), ls="--", marker="o", ms=5, label=f"{run.label}: validation")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("Training and validation loss", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax, runs)
    return _save(fig, path)


def throughput(runs: list[Run], path: Path) -> Path | None:
    if not any(r.train for r in runs):
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, run in enumerate(runs):
        a.plot(*_series(run.train, "step", "tokens_per_s"), color=_color(i), lw=1, label=run.label)
        xs, ys = _series(run.train, "step", "mfu")
        b.plot(xs, [100 * y for y in ys], color=_color(i), lw=1, label=run.label)
    a.set(xlabel="step", ylabel="tokens/s (whole job)")
    b.set(xlabel="step", ylabel="MFU (%)")
    a.set_title("Throughput", loc="left", fontsize=10)
    b.set_title("Model FLOPs utilisation", loc="left", fontsize=10)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    _legend(a, runs)
    return _save(fig, path)


def optimizer(runs: list[Run], path: Path) -> Path | None:
    if not any(r.train for r in runs):
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, run in enumerate(runs):
        a.plot(*_series(run.train, "step", "grad_norm"), color=_color(i), lw=1, label=run.label)
        b.plot(*_series(run.train, "step", "lr"), color=_color(i), lw=1.2, label=run.label)
    a.set(xlabel="step", ylabel="gradient norm (before clipping)", yscale="log")
    b.set(xlabel="step", ylabel="learning rate")
    a.set_title("Gradient norm", loc="left", fontsize=10)
    b.set_title("Learning rate", loc="left", fontsize=10)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    _legend(a, runs)
    return _save(fig, path)


def batch_size(runs: list[Run], path: Path) -> Path | None:
    """The global batch over steps where it changed (train.batch_ramp, fixed or "auto"), and the
    gradient noise scale measured for "auto" (grad_noise_scale: the batch it grows toward)."""
    shown = [(i, r) for i, r in enumerate(runs)
             if len({row.get("global_batch") for row in r.train} - {None}) > 1
             or any("grad_noise_scale" in row for row in r.train)]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, run in shown:
        ax.step(*_series(run.train, "step", "global_batch"), where="post", color=_color(i), lw=1.5,
                label=f"{run.label}: global batch")
        xs, ys = _series(run.train, "step", "grad_noise_scale")
        if xs:
            ax.plot(xs, ys, color=_color(i), lw=0.8, ls=":", label=f"{run.label}: gradient noise scale")
    ax.set(xlabel="step", ylabel="sequences", yscale="log")
    ax.set_title("Global batch (steps) and measured gradient noise scale (dotted)", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def per_rank_memory(run: Run) -> list[float]:
    """Each rank's peak memory (MB) over the run; rank 0's training rows when no per-rank rows
    were gathered (one process, or a run shorter than a straggler window)."""
    rows = [r["rank_peak_memory_mb"] for r in run.ranks if isinstance(r.get("rank_peak_memory_mb"), list)]
    if rows:
        width = max(len(r) for r in rows)
        return [max(r[k] for r in rows if k < len(r)) for k in range(width)]
    _, ys = _series(run.train, "step", "peak_memory_mb")
    return [max(ys)] if ys else []


def memory(runs: list[Run], path: Path) -> Path | None:
    per_run = [per_rank_memory(r) for r in runs]
    if not any(per_run):
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(runs)
    for i, (run, mem) in enumerate(zip(runs, per_run)):
        xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(mem))]
        a.bar(xs, mem, width=width, color=_color(i), label=run.label)
        b.plot(*_series(run.train, "step", "peak_memory_mb"), color=_color(i), lw=1.2, label=run.label)
    ranks = max(len(m) for m in per_run)
    a.set_xticks(range(ranks))
    a.set_xlim(-0.75, ranks - 0.25)
    a.set_xticklabels([f"rank {k}" for k in range(ranks)], fontsize=8, rotation=0 if ranks <= 8 else 90)
    a.set(ylabel="peak memory (MB)")
    a.set_title("Peak memory per rank (device memory on GPU, RSS on CPU)", loc="left", fontsize=10)
    b.set(xlabel="step", ylabel="rank 0 peak memory (MB)")
    b.set_title("Rank 0 over the run", loc="left", fontsize=10)
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    _legend(a, runs)
    return _save(fig, path)


def stragglers(runs: list[Run], path: Path) -> Path | None:
    """Busy time per step of every rank, per straggler window: a slow rank stands out above the
    others (time waiting in collectives is not busy time on CPU)."""
    if not any(isinstance(r.get("rank_busy_s"), list) for run in runs for r in run.ranks):
        return None  # the last step's memory-only row carries no busy times
    fig, ax = plt.subplots(figsize=(10, 3.8))
    one = len(runs) == 1
    for i, run in enumerate(runs):
        rows = [r for r in run.ranks if isinstance(r.get("rank_busy_s"), list)]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        per_rank = list(zip(*[r["rank_busy_s"] for r in rows]))
        if one and len(per_rank) <= 8:
            for k, ys in enumerate(per_rank):
                ax.plot(steps, [1000 * y for y in ys], marker=".", lw=1, color=_color(k), label=f"rank {k}")
        else:
            lo = [1000 * min(r["rank_busy_s"]) for r in rows]
            hi = [1000 * max(r["rank_busy_s"]) for r in rows]
            ax.fill_between(steps, lo, hi, color=_color(i), alpha=0.25)
            ax.plot(steps, hi, color=_color(i), lw=1, label=f"{run.label}: slowest rank (band: fastest to slowest)")
        for e in run.events:
            if e.get("event") == "straggler":
                ax.axvline(e["step"], color=MARKS["straggler"][0], ls=":", lw=1)
                ax.annotate(f"rank {e.get('rank')} {e.get('ratio', 0):.2f}x", (e["step"], ax.get_ylim()[1]),
                            fontsize=7, color=MARKS["straggler"][0], rotation=90, va="top", ha="right")
    ax.set(xlabel="step (end of each straggler window)", ylabel="busy time per step (ms)")
    ax.set_title("Step-time spread across ranks", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds < 180:
        return 1.0, "seconds"
    if seconds < 3 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def timeline(runs: list[Run], path: Path) -> Path | None:
    """Step against wall time: flat stretches are stalls, a drop is a restart or a rollback that
    went back to a checkpoint; every save, restart and skipped step is marked."""
    spans = [r.time_span() for r in runs]
    if not any(r.train for r in runs) or not any(spans):
        return None
    fig, ax = plt.subplots(figsize=(10, 4.2))
    seen = set()
    unit, unit_name = _time_unit(max(s[1] - s[0] for s in spans if s))

    def _at(t: float, t0: float) -> float:
        return (t - t0) / unit

    def mark(kind: str, x: float, y: float, marker: str, size: float = 40, color=None) -> None:
        label = MARKS[kind][1]
        ax.scatter([x], [y], marker=marker, s=size, color=color or MARKS[kind][0], zorder=5,
                   edgecolors="black" if color else "face", linewidths=0.6,
                   label=None if kind in seen else label + (" (in its run's colour)" if color else ""))
        seen.add(kind)

    for i, (run, span) in enumerate(zip(runs, spans)):
        if span is None:
            continue
        t0 = span[0]
        if run.superseded:
            xs, ys = _series(run.superseded, "time", "step")
            ax.scatter([_at(x, t0) for x in xs], ys, s=4, color="0.6",
                       label="steps a restart or rollback redid" if "redo" not in seen else None)
            seen.add("redo")
        xs, ys = _series(run.train, "time", "step")
        # No line across a restart: the stretch between attempts trained nothing.
        cuts = sorted(e["time"] for e in run.restarts + run.resumes if e.get("time") is not None)
        px, py = [], []
        for k, (x, y) in enumerate(zip(xs, ys)):
            if k and any(xs[k - 1] < c <= x for c in cuts):
                px.append(float("nan"))
                py.append(float("nan"))
            px.append(_at(x, t0))
            py.append(y)
        ax.plot(px, py, color=_color(i), lw=1.5, label=run.label)
        for c in run.checkpoints:  # overlaid runs: each run's saves in its line's colour
            if "time" in c:
                mark("checkpoint", _at(c["time"], t0), c["step"], "^", color=_color(i) if len(runs) > 1 else None)
        for r in run.train:
            if r.get("skipped") and "time" in r:
                mark("skipped", _at(r["time"], t0), r["step"], "x", 50)
        # a restart after a failure, dashed; the user's own stop and start again (nothing lost), dotted
        lines = [("restart", "--", 6, f"restart {k + 1} at step", e) for k, e in enumerate(run.restarts)] + \
                [("resume", ":", -10, "resumed at step", e) for e in run.resumes]
        for kind, style, dy, text, e in lines:
            if e.get("time") is None:
                continue
            x = _at(e["time"], t0)
            color, label = MARKS[kind]
            ax.axvline(x, color=color, lw=1, ls=style, label=None if kind in seen else label)
            seen.add(kind)
            world = f", world {e['world']}" if e.get("world") else ""
            ax.annotate(f"{text} {e['step']}{world}", (x, e["step"]), fontsize=7, color=color,
                        xytext=(4, dy), textcoords="offset points")
        for e in run.events:
            if e.get("event") in ("rollback", "skip_window", "straggler") and e.get("time") is not None:
                mark(e["event"], _at(e["time"], t0), e["step"], {"rollback": "v", "skip_window": "s"}
                     .get(e["event"], "D"))
    ax.set(xlabel=f"wall time since the run's first row ({unit_name})", ylabel="step")
    ax.set_title("Progress over time: checkpoints, restarts, skipped and rolled-back steps", loc="left",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


PHASE_COLORS = [("save_s", "save", "#2ca02c"), ("rendezvous_s", "re-rendezvous", "#d62728"),
                ("reshard_s", "reshard", "#ff7f0e"), ("warmup_s", "warm-up", "#9467bd")]


def world(runs: list[Run], path: Path) -> Path | None:
    """Ranks against wall time for runs whose world changed (self-healing, or a user's resume on
    another number of ranks), each self-healing membership change's stop shaded by phase (run_data.membership_phases: save, re-rendezvous, reshard,
    warm-up)."""
    changed = [(i, r) for i, r in enumerate(runs) if len(world_over_time(r)) > 1 and r.time_span()]
    if not changed:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.2))
    unit, unit_name = _time_unit(max(r.time_span()[1] - r.time_span()[0] for _, r in changed))
    seen = set()
    for i, run in changed:
        t0, t1 = run.time_span()
        stretches = world_over_time(run)
        xs = [w["since_s"] / unit for w in stretches] + [(t1 - t0) / unit]
        ys = [w["world"] for w in stretches] + [stretches[-1]["world"]]
        ax.step(xs, ys, where="post", color=_color(i), lw=1.8, label=f"{run.label}: ranks")
        for p in membership_phases(run):
            at = (p["begin_time"] - t0) / unit
            for key, name, color in PHASE_COLORS:
                if p.get(key) is None or p[key] <= 0:
                    continue
                ax.axvspan(at, at + p[key] / unit, color=color, alpha=0.25, lw=0, label=None if name in seen else name)
                seen.add(name)
                at += p[key] / unit
    ax.set(xlabel=f"wall time since the run's first row ({unit_name})", ylabel="ranks")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title("World size over time; each membership change's stop, by phase", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def moe_load(runs: list[Run], path: Path) -> Path | None:
    """Tokens routed to each expert of each MoE layer (the last quarter of the run, as a share
    of the mean: 1.0 is perfect balance), and the worst layer's imbalance over the run."""
    moe_runs = [(i, r) for i, r in enumerate(runs) if any("moe/imbalance" in row for row in r.train)]
    if not moe_runs:
        return None
    fig, axes = plt.subplots(1, len(moe_runs) + 1, figsize=(5 * (len(moe_runs) + 1), 3.8), squeeze=False)
    for ax, (i, run) in zip(axes[0], moe_runs):
        keys = sorted({k for row in run.train for k in row if k.endswith("/tokens_per_expert")},
                      key=lambda k: int(k.split("/")[1].removeprefix("layer")))
        tail = run.train[-max(1, len(run.train) // 4):]
        grid = []
        for k in keys:
            loads = [row[k] for row in tail if isinstance(row.get(k), list)]
            total = [sum(col) for col in zip(*loads)]
            mean = sum(total) / len(total) if total else 1.0
            grid.append([t / mean if mean else 0.0 for t in total])
        if grid:
            im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
            ax.set_yticks(range(len(keys)))
            ax.set_yticklabels([k.split("/")[1] for k in keys], fontsize=8)
            ax.set_xlabel("expert")
            fig.colorbar(im, ax=ax, label="load / mean load")
        ax.set_title(f"{run.label}: expert load", loc="left", fontsize=10)
    ax = axes[0][-1]
    for i, run in moe_runs:
        ax.plot(*_series(run.train, "step", "moe/imbalance"), color=_color(i), lw=1, label=run.label)
    ax.set(xlabel="step", ylabel="max / mean expert load (worst layer)")
    ax.set_title("Routing imbalance", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(ax, runs)
    return _save(fig, path)


def pipeline_gantt(runs: list[Run], path: Path) -> Path | None:
    """The traced step of every run that recorded one, drawn by the pipeline report's own Gantt."""
    from ndtrain.tools.pipeline_report import draw_gantt, measured_panel, summarize

    panels = []
    for run in runs:
        t = run.pipeline
        if not t or not t.get("ranks") or not all(r.get("traces") for r in t["ranks"]):
            continue
        s = summarize(t["ranks"], t["schedule"], t["p"], t["v"], warmup=0)
        panel = measured_panel(t["ranks"], s, 0)
        panel["title"] = f"{run.label}, step {t.get('step', '?')}: {panel['title']}"
        panels.append(panel)
    return draw_gantt(panels, path) if panels else None


FIGURES = [  # (file suffix, section title, function)
    ("loss", "Loss", loss),
    ("throughput", "Throughput and MFU", throughput),
    ("optimizer", "Gradient norm and learning rate", optimizer),
    ("batch", "Global batch and gradient noise scale", batch_size),
    ("memory", "Peak memory per rank", memory),
    ("stragglers", "Step-time spread across ranks", stragglers),
    ("timeline", "Checkpoints, restarts, skipped and rolled-back steps", timeline),
    ("world", "World size over time (self-healing changes and resumes on other ranks)", world),
    ("moe", "Mixture of experts: expert load", moe_load),
    ("pipeline", "Pipeline schedule (Gantt)", pipeline_gantt),
]
