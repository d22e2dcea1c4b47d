"""`ndtrain report RUN_DIR [RUN_DIR ...] --out report.html`: a run, or several overlaid, at a
glance. One self-contained HTML file (every image embedded as a data URI, nothing fetched from
the network, no script) plus the same PNGs beside it (`<out stem>-<figure>.png`). A file of those
names that the report at --out did not write is never replaced: the report refuses instead.

It reads what the run directory holds (config.toml, metrics.jsonl, pipeline_trace.json), so
it works on a run that is still going and on one that crashed and restarted; torch is not
imported.
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import statistics
import time
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.tools.run_data import Run, config_differences, membership_phases, read_run, world_over_time

GENERATOR = "ndtrain report"


# ---- checking --out before any work --------------------------------------------------------

def check_out(out: Path) -> None:
    """The report may replace an earlier report, never anything else."""
    if out.suffix.lower() not in (".html", ".htm"):
        raise NdtrainError(f"--out {out}: must name an .html file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist"
        raise NdtrainError(f"--out {out}: {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NdtrainError(f"--out {out}: directory {parent} is not writable")
    if out.is_dir():
        raise NdtrainError(f"--out {out}: is a directory")
    if out.exists():
        with open(out, "rb") as f:
            head = f.read(4096)
        if f'name="generator" content="{GENERATOR}"'.encode() not in head:
            raise NdtrainError(f"--out {out}: exists and is not an ndtrain report; refusing to overwrite it")
        if not os.access(out, os.W_OK):
            raise NdtrainError(f"--out {out}: is not writable")


def figure_path(out: Path, suffix: str) -> Path:
    return out.with_name(f"{out.stem}-{suffix}.png")


def check_figures(out: Path, suffixes: list[str]) -> dict[Path, bytes]:
    """A figure file beside --out may be replaced only when the report at --out embeds exactly
    its bytes: that report wrote it and nobody changed it since. Anything else of those names is
    the user's, and the report is refused before it draws anything. Returns the earlier report's
    figures (path -> bytes): the ones this report does not draw again are removed with it."""
    report, ours = None, {}
    for suffix in suffixes:
        target = figure_path(out, suffix)
        if not os.path.lexists(target):
            continue
        if report is None:  # check_out let through only a report of ours at --out
            report = out.read_bytes() if out.is_file() else b""
        data = target.read_bytes() if target.is_file() and not target.is_symlink() and \
            target.stat().st_size < len(report) else None
        if data is None or b'src="data:image/png;base64,' + base64.b64encode(data) + b'"' not in report:
            raise NdtrainError(f"--out {out}: {target} exists and is not a figure of the report at {out}; refusing "
                               f"to replace it (move it aside, or choose another --out)")
        ours[target] = data
    return ours


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- the header table ----------------------------------------------------------------------

def _num(x, fmt: str = ",.0f") -> str:
    return "–" if x is None else format(x, fmt)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _status(run: Run, now: float) -> str:
    if run.finished:
        return "finished"
    if not run.train:
        return "no training step logged yet"
    span = run.time_span()
    ago = f", last row {_duration(now - span[1])} ago" if span else ""
    total = run.section("train").get("steps")
    return f"not finished: step {run.train[-1]['step']}{f' of {total}' if total else ''}{ago} (running, or stopped)"


def _model(run: Run) -> str:
    m = run.section("model")
    if not m:
        return "–"
    moe = f", {m['n_experts']} experts (top {m.get('n_active_experts')})" if m.get("n_experts") else ""
    return (f"{m.get('preset', '?')}: dim {m.get('dim')}, {m.get('n_layers')} layers, {m.get('n_heads')} heads "
            f"({m.get('n_kv_heads')} kv), vocab {m.get('vocab_size')}{moe}")


def _median(rows: list[dict], key: str, since_step: int) -> float | None:
    vals = [r[key] for r in rows if r["step"] > since_step and isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def _phase(name: str, seconds: float | None) -> str:
    return f"{name} {seconds:.1f} s" if seconds is not None else f"{name} –"


def membership_changes(run: Run) -> str:
    """Each change of world (train/resilience.py's `membership` rows): the step, old -> new ranks,
    why (its first words), and the time it cost, phase by phase (run_data.membership_phases):
    detection (trained on meanwhile), then save, re-rendezvous, reshard and warm-up, which stop
    training."""
    out = []
    for p in membership_phases(run):
        head = f"step {p['step']}: {p['old_world']} -> {p['world']} ranks ({p['why']})"
        rdzv = _phase("re-rendezvous", p["rendezvous_s"])
        if p["startup_s"] is not None:
            rdzv += f" (worker start-up {p['startup_s']:.1f} s)"
        parts = [_phase("save", p["save_s"]), rdzv, _phase("reshard", p["reshard_s"])]
        if p["warmup_s"] is not None:
            lost = p["gap_s"] - p["warmup_steps"] * p["steady_step_s"]
            warm = _phase("warm-up", p["warmup_s"])
            if p["outside_steps_s"] is not None and p["outside_steps_s"] >= 0.5:
                warm += f" ({p['outside_steps_s']:.1f} s of it before and between the steps)"
            parts.append(warm)
            cost = f"{lost:.0f} s lost: " + ", ".join(parts)
        else:
            again = "changed again before any steady step" if p["changed_again"] else "no steady steps yet"
            cost = ", ".join(parts) + f"; {again}"
        if p["detection_s"] is not None:
            cost += f"; detected over {p['detection_s']:.1f} s before (trained on, at the old pace)"
        out.append(f"{head}: {cost}")
    return " | ".join(out) or "none"


AFTER = {"finished": "finished", "stopped": "was stopped (a signal)", "interrupted": "was interrupted (Ctrl-C)",
         "left": "left the group", None: "ended without a record (a crash, or an older ndtrain)"}


def resumes(run: Run) -> str:
    """Each attempt a new launch began (a user's `ndtrain train` again): the step, the world
    before and after, how the attempt before it ended, and the time between them, which was the
    user's and is not counted as lost."""
    out, world = [], None
    for e in run.starts:
        if e.get("kind") == "resume":
            ranks = f"{world} -> {e.get('world')} ranks" if world != e.get("world") else f"{e.get('world')} ranks"
            pause = f"; {_duration(e['since_previous_s'])} from its end to this start" \
                if e.get("since_previous_s") is not None else ""
            out.append(f"step {e['step']} on {ranks}: the attempt before {AFTER.get(e.get('after'), e.get('after'))}"
                       f"{pause} (the user's pause and the new start-up, not lost to a failure)")
        world = e.get("world")
    return " | ".join(out) or "none"


def self_healing(run: Run) -> bool:
    """Whether a change of world in this run was torch elastic's (a resume's is the user's)."""
    return any(e.get("event") == "membership" and not e.get("resume") for e in run.events)


def world_timeline(run: Run) -> str:
    """The world size over time: each stretch's ranks, from when (since the run's first row) and
    from which step."""
    parts = [f"{w['world']} ranks from {_duration(w['since_s'])} (step {w['step']})" for w in world_over_time(run)]
    return ", ".join(parts) or "–"


def header_rows(runs: list[Run], now: float, profile: str | None = None) -> list[tuple[str, list[str]]]:
    """`profile`: the hardware profile the "predicted now" row prices each run's layout on
    (default: this machine's, as `ndtrain plan` reads it)."""
    from ndtrain.tools.run_calibrate import predicted_vs_measured

    rows: list[tuple[str, list[str]]] = []

    def add(name: str, fn) -> None:
        rows.append((name, [fn(r) for r in runs]))

    def wall(run: Run) -> str:
        span = run.time_span()
        return _duration(span[1] - span[0]) if span else "–"

    def warm(run: Run) -> int:  # the last attempt's first steps pay for start-up
        return (run.starts[-1]["step"] if run.starts else 0) + 3

    def auto(run: Run) -> str:
        a = run.auto
        if a is None:
            return "not used"
        measured = run.measured_step_time()
        ratio = f" ({measured / a['predicted_step_time']:.2f}x)" if measured and a.get("predicted_step_time") else ""
        return (f"{a.get('layout', '')}; predicted {_num(a.get('predicted_step_time'), '.3f')} s/step, measured "
                f"{_num(measured, '.3f')} s/step{ratio}")

    add("run directory", lambda r: str(r.path))
    add("status", lambda r: _status(r, now))
    add("model", _model)
    add("parameters", lambda r: _num(r.params()))
    add("layout", lambda r: f"{r.layout()} (precision {r.section('parallel').get('mixed_precision', '?')})")
    add("world", lambda r: _num(r.world()))
    add("steps", lambda r: f"{r.train[-1]['step'] if r.train else 0} of {r.section('train').get('steps', '?')}")
    add("tokens", lambda r: _num(r.train[-1].get("tokens_seen") if r.train else None))
    add("wall time", wall)
    add("final training loss", lambda r: _num(r.train[-1]["loss"] if r.train else None, ".4f"))
    add("final validation loss", lambda r: _num(r.val[-1]["val_loss"] if r.val else None, ".4f"))
    add("tokens/s (median, last attempt)", lambda r: _num(_median(r.train, "tokens_per_s", warm(r))))
    add("MFU (median, last attempt)", lambda r: _num(_median(r.train, "mfu", warm(r)), ".1%"))
    add("restarts / rollbacks / skipped steps", lambda r: f"{len(r.restarts)} / {r.count('rollback')} / "
        f"{sum(1 for x in r.train if x.get('skipped'))}")
    if any(r.resumes for r in runs):
        add("resumed by a new launch (ndtrain train again)", resumes)
    if any(self_healing(r) for r in runs):
        add("membership changes (self-healing)", membership_changes)
    if any(len(world_over_time(r)) > 1 for r in runs):
        add("world size over time", world_timeline)
    add("checkpoints saved", lambda r: str(len(r.checkpoints)))
    add("planner (auto): predicted vs measured", auto)
    add("step: predicted now vs measured", lambda r: predicted_vs_measured(r, profile))
    if any(r.unreadable_lines for r in runs):
        add("unreadable metrics lines", lambda r: f"{r.unreadable_lines} (a live run's last line, or torn by a crash)")
    for key, values in config_differences(runs).items():
        rows.append((f"differs: {key}", [str(v) for v in values]))
    return rows


# ---- HTML ----------------------------------------------------------------------------------

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1060px;color:#222}h1{font-size:22px;margin-bottom:4px}h2{font-size:16px;margin-top:28px;
border-bottom:1px solid #ddd;padding-bottom:4px}table{border-collapse:collapse;font-size:13px;width:100%}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f5f5f5;
width:230px}td.run{font-weight:600}img{max-width:100%;height:auto;display:block}.note{color:#666;
font-size:12px}.swatch{display:inline-block;width:10px;height:10px;margin-right:6px}"""


def render_html(runs: list[Run], figures: list[tuple[str, Path]], now: float, profile: str | None = None) -> str:
    from ndtrain.tools.report_plots import COLORS

    def swatch(i: int) -> str:
        r, g, b = (int(255 * c) for c in COLORS[i % len(COLORS)])
        return f'<span class="swatch" style="background:#{r:02x}{g:02x}{b:02x}"></span>'

    esc = html.escape
    title = "ndtrain report: " + ", ".join(r.label for r in runs)
    head = "".join(f'<td class="run">{swatch(i)}{esc(r.label)}</td>' for i, r in enumerate(runs))
    body = "".join(f"<tr><th>{esc(name)}</th>{''.join(f'<td>{esc(v)}</td>' for v in values)}</tr>"
                   for name, values in header_rows(runs, now, profile))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta name="generator" content="{GENERATOR}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="note">generated {time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))} from the run '
        f"directories as they were then; steps that a restart or rollback redid are shown once, as the "
        f"later attempt logged them.</p>",
        f"<table><tr><th></th>{head}</tr>{body}</table>",
    ]
    for section, png in figures:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts += [f"<h2>{esc(section)}</h2>",
                  f'<img src="data:image/png;base64,{data}" alt="{esc(section)}">']
    missing = [r.label for r in runs if r.pipeline is None and r.section("parallel").get("pp", 1) > 1]
    if missing:
        parts.append(f'<p class="note">no pipeline trace in {esc(", ".join(missing))} (recorded at step '
                     f"logging.pipeline_trace_step of a pp &gt; 1 run).</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def build_report(run_dirs: list[str], out: str | Path, profile: str | None = None) -> tuple[Path, list[Path]]:
    """Read every run, draw every figure that some run has data for, write the HTML and PNGs;
    `profile` prices each run's layout for the predicted-vs-measured row."""
    from ndtrain.tools.report_plots import FIGURES

    out = Path(out)
    check_out(out)
    earlier = check_figures(out, [suffix for suffix, _, _ in FIGURES])
    if profile:  # a missing or unreadable profile is refused before any work, not printed in a cell
        from ndtrain.planner.profile import read_profile

        read_profile(profile)
    runs = [read_run(d) for d in run_dirs]
    labels = [r.label for r in runs]
    for r in runs:  # two runs with one directory name (e.g. a/run, b/run): label by path
        if labels.count(r.label) > 1:
            r.label = str(r.path)
    now = time.time()
    pngs: list[tuple[str, Path]] = []
    for suffix, section, draw in FIGURES:
        target = figure_path(out, suffix)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}.png")
        try:
            if draw(runs, tmp) is not None:
                os.replace(tmp, target)
                pngs.append((section, target))
        finally:
            tmp.unlink(missing_ok=True)
    _write_atomic(out, render_html(runs, pngs, now, profile).encode("utf-8"))
    drawn = {p for _, p in pngs}
    for path, data in earlier.items():  # the earlier report's figures this one has not: theirs went with it
        if path not in drawn and path.is_file() and not path.is_symlink() and path.read_bytes() == data:
            path.unlink()
    return out, [p for _, p in pngs]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several overlay on one set of axes)")
    p.add_argument("--out", default="report.html", help="the HTML file to write; PNGs go beside it (default report.html)")
    p.add_argument("--profile", help="hardware profile for the predicted-vs-measured row (default: this machine's; "
                   "a GPU profile prices its GPU)")
    args = p.parse_args(argv)
    out, pngs = build_report(args.run_dirs, args.out, args.profile)
    print(f"wrote {out} ({len(pngs)} figures; PNGs beside it: {', '.join(p.name for p in pngs)})")
    for run in [read_run(d) for d in args.run_dirs]:  # self-healing: what each change cost, on the terminal too
        if self_healing(run):
            print(f"{run.path}: world size over time: {world_timeline(run)}")
            for change in membership_changes(run).split(" | "):
                print(f"  {change}")
    return 0
