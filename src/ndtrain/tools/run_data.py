"""Reading a run directory for the report: what the run is (config, layout, world) and what it
did (the training timeline as it stands after every restart and rollback, and the events that
shaped it). Torch-free: a report is drawn on any machine that has the run directory.

A run that is still going is read as it is now (a half-written last line is skipped); a run
that crashed and restarted from a checkpoint logged some steps twice: the later attempt's rows
win, and the ones they replace are kept apart (`superseded`) so the timeline can show them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.layout.flops import shown_fraction
from ndtrain.tools.attempts import classify_attempts

EVENTS_THAT_REWIND = ("start", "restart", "rollback")
# Keys the report computes with: a row that gives one of them as anything but a number (or null)
# was not written by ndtrain, and is refused by file and line rather than drawn wrong.
NUMERIC_KEYS = ("loss", "val_loss", "time", "lr", "grad_norm", "tokens_per_s", "mfu", "mfu_fp8", "step_time_s",
                "tokens_seen", "peak_memory_mb", "checkpoint_stall_s", "checkpoint_total_s", "world", "old_world",
                "attempt", "ratio", "worker_started", "imported", "predicted_step_time")


@dataclass
class Run:
    path: Path
    label: str
    config: dict
    train: list[dict] = field(default_factory=list)  # training rows of the surviving timeline, by step
    val: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # start, restart, rollback, skip_window, straggler, ...
    ranks: list[dict] = field(default_factory=list)  # rank_busy_s / rank_peak_memory_mb rows
    superseded: list[dict] = field(default_factory=list)  # training rows a restart or rollback replaced
    unreadable_lines: int = 0
    pipeline: dict | None = None  # pipeline_trace.json

    # ---- what the header table shows --------------------------------------------------------
    @property
    def finished(self) -> bool:
        return bool(self.train) and bool(self.train[-1].get("last"))

    @property
    def starts(self) -> list[dict]:
        return [e for e in self.events if e.get("event") in ("start", "restart")]

    @property
    def restarts(self) -> list[dict]:
        """Attempts after the first that torchrun began (after a failure, or re-forming the group),
        or step regressions in runs from before attempts were logged; not a user's resume."""
        return [e for e in self.starts[1:] if e.get("kind") != "resume"] + \
            [e for e in self.events if e.get("event") == "restart (inferred)"]

    @property
    def resumes(self) -> list[dict]:
        """Attempts a new launch began (a user's `ndtrain train` again, --checkpoint.resume=auto):
        the time before them was the user's, not lost to a failure."""
        return [e for e in self.starts[1:] if e.get("kind") == "resume"]

    def count(self, event: str) -> int:
        return sum(1 for e in self.events if e.get("event") == event)

    @property
    def auto(self) -> dict | None:
        """The planner's choice for the last attempt (an earlier attempt's, on another world, is
        not what the last attempt's measured steps ran)."""
        last = max((i for i, e in enumerate(self.events) if e.get("event") in ("start", "restart")), default=-1)
        autos = [e for e in self.events[last + 1:] if e.get("event") == "auto"]
        return autos[-1] if autos else None

    def timed_rows(self) -> list[dict]:
        """The last attempt's training rows with a step time, past its first 3 steps (warm-up)."""
        first = self.starts[-1]["step"] if self.starts else 0
        return [r for r in self.train if r["step"] > first + 3 and "step_time_s" in r]

    def measured_step_time(self) -> float | None:
        """Median step time of the last attempt, past its first 3 steps (warm-up)."""
        times = [r["step_time_s"] for r in self.timed_rows()]
        return statistics.median(times) if times else None

    def section(self, name: str) -> dict:
        value = self.config.get(name, {})
        return value if isinstance(value, dict) else {}

    def layout(self) -> str:
        if self.starts:
            return str(self.starts[-1].get("layout", "?"))
        par = self.section("parallel")
        degrees = [f"{k}={par[k]}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                   if k in par and par[k] != 1]
        return " x ".join(degrees) or "single"

    def world(self) -> int | None:
        return self.starts[-1].get("world") if self.starts else None

    def params(self) -> int | None:
        from ndtrain.model.config import ModelConfig, num_params

        names = {f.name for f in dataclasses.fields(ModelConfig)}
        try:
            return num_params(ModelConfig(**{k: v for k, v in self.section("model").items() if k in names}))
        except (TypeError, ValueError, ZeroDivisionError):
            return None

    def time_span(self) -> tuple[float, float] | None:
        times = [r["time"] for r in self.all_rows() if isinstance(r.get("time"), (int, float))]
        return (min(times), max(times)) if times else None

    def all_rows(self) -> list[dict]:
        return self.train + self.val + self.checkpoints + self.events + self.ranks + self.superseded


def _check_dir(path: Path) -> None:
    if not path.exists():
        raise NdtrainError(f"run directory not found: {path}")
    if not path.is_dir():
        raise NdtrainError(f"{path} is not a directory (give a run directory, e.g. runs/default-20261130-120000)")
    if not (path / "metrics.jsonl").is_file() and not (path / "config.toml").is_file():
        raise NdtrainError(f"{path} is not a run directory: it has neither metrics.jsonl nor config.toml")


def read_rows(path: Path) -> tuple[list[dict], int]:
    """Rows of metrics.jsonl in file order, and how many lines could not be read (a live run's
    half-written last line, or a line torn by a crash)."""
    if not path.is_file():
        return [], 0
    rows, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                for key in NUMERIC_KEYS:
                    value = row.get(key)
                    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                        raise NdtrainError(f"{path}, line {number}: {key!r} is {str(value)[:40]!r}, not a number; "
                                           f"this row was not written by ndtrain (fix or remove the line)")
                for key in ("mfu", "mfu_fp8"):  # an older ndtrain logged MFU above 100% (a wrong peak)
                    if row.get(key) is not None:
                        row[key] = shown_fraction(row[key])
                rows.append(row)
            else:
                bad += 1
    return rows, bad


def _fill_times(rows: list[dict]) -> None:
    """Rows written before every row carried a wall time take the time of the nearest training
    row at or before their step."""
    last = None
    for r in rows:
        if isinstance(r.get("time"), (int, float)):
            last = r["time"]
        elif last is not None:
            r["time"] = last


def read_run(path: str | Path, label: str | None = None) -> Run:
    path = Path(path)
    _check_dir(path)
    config = {}
    if (path / "config.toml").is_file():
        try:
            config = tomllib.loads((path / "config.toml").read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise NdtrainError(f"{path / 'config.toml'}: not valid TOML: {exc}") from None
    rows, bad = read_rows(path / "metrics.jsonl")
    _fill_times(rows)
    run = Run(path=path, label=label or path.name, config=config, unreadable_lines=bad)
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}

    def rewind(to_step: int) -> None:
        """Rows past `to_step` belong to a timeline that was abandoned."""
        for step in [s for s in train if s > to_step]:
            run.superseded.append(train.pop(step))
        for step in [s for s in val if s > to_step]:
            del val[step]

    rewound = False  # a start/restart/rollback row came after the last training row
    for row in rows:
        step = row["step"]
        if "loss" in row:
            if train and step <= max(train):
                if not rewound:
                    # A step logged again with no restart row before it (a run from before
                    # restarts were logged): a restart from the step before.
                    run.events.append({"step": step - 1, "event": "restart (inferred)", "time": row.get("time")})
                rewind(step - 1)
            train[step] = row
            rewound = False
        elif "val_loss" in row:
            val[step] = row
        elif "checkpoint_mode" in row:
            run.checkpoints.append(row)
        elif "event" in row:
            if row["event"] in EVENTS_THAT_REWIND:
                rewind(step)
                rewound = True
            run.events.append(row)
        elif "rank_busy_s" in row or "rank_peak_memory_mb" in row:
            run.ranks.append(row)
    classify_attempts(rows)
    run.train = [train[s] for s in sorted(train)]
    run.val = [val[s] for s in sorted(val)]
    trace = path / "pipeline_trace.json"
    if trace.is_file():
        try:
            run.pipeline = json.loads(trace.read_text())
        except ValueError:
            run.pipeline = None  # written by rank 0 in one go; a torn file is simply not drawn
    return run


def tokens_at(run: Run, step: int) -> float | None:
    """Tokens seen after `step` (validation rows carry only the step)."""
    best = None
    for r in run.train:
        if r["step"] <= step:
            best = r.get("tokens_seen")
        else:
            break
    return best


def config_differences(runs: list[Run]) -> dict[str, list]:
    """section.key -> value per run, for the keys whose values differ between runs."""
    if len(runs) < 2:
        return {}
    flat = []
    for run in runs:
        d = {}
        for section, values in run.config.items():
            if isinstance(values, dict):
                d.update({f"{section}.{k}": v for k, v in values.items()})
            else:
                d[section] = values
        flat.append(d)
    keys = sorted(set().union(*flat))
    ignore = {"train.output_dir", "name", "checkpoint.dir", "checkpoint.resume"}
    return {k: [d.get(k) for d in flat] for k in keys
            if k not in ignore and len({json.dumps(d.get(k), sort_keys=True) for d in flat}) > 1}


# ---- self-healing: what each membership change cost, and the world over time ----------------
WARMUP_STEPS = 3  # the new world's first steps, priced against its steady step time


def _failure_times(run: Run, host: str) -> list[float]:
    """When the failure ledger (train/resilience.py) struck `host`, oldest first."""
    rows = []
    try:
        lines = (run.path / "resilience" / "failures.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("host") == host and isinstance(row.get("time"), (int, float)):
            rows.append(row["time"])
    return sorted(rows)


def _detection(run: Run, exclude: dict, steps: list[dict]) -> float | None:
    """Seconds from the first sign to the decision (the `exclude` row): the start of the first of
    the K slow windows running that named the host's rank (its `straggler` rows begin at the K-th),
    the first of the failures counted, or (a host back with grow_back=false) its attempt's start."""
    at = exclude["time"]
    reason = str(exclude.get("reason") or "")
    if "on_straggler" in reason:
        window = run.section("train").get("straggler_window") or 0
        named = sorted({e["step"]: e for e in run.events if e.get("event") == "straggler"
                        and e.get("time", at + 1) <= at and e.get("rank") in (exclude.get("ranks") or [])}.items())
        if not named:
            return None
        first = named[-1][1]
        for s, e in reversed(named[:-1]):  # the streak: one window after another, `window` steps apart
            if not window or first["step"] - s != window:
                break
            first = e
        # a rank is named from its K-th slow window running on (train/recovery.py's judge)
        opened = first["step"] - window * (run.section("resilience").get("straggler_windows") or 1)
        began = [r["time"] for r in steps + run.starts if r["step"] == opened and r["time"] <= at]
        return at - (began[-1] if began else first["time"])
    if "on_failure" in reason:
        limit = run.section("resilience").get("failure_window_s", 3600)
        count = run.section("resilience").get("failures", 1)
        struck = [t for t in _failure_times(run, exclude.get("host")) if at - limit <= t <= at]
        return at - struck[-count:][0] if struck else None
    starts = [e["time"] for e in run.starts if e.get("time") is not None and e["time"] <= at]
    return at - starts[-1] if starts else None


def membership_phases(run: Run) -> list[dict]:
    """Per `membership` row (a change of world, train/resilience.py), where the wall time went,
    each phase from one record to the next (docs/self-healing.md defines them):
      detection   first sign -> the decision (trained on meanwhile, at the old pace; not in `gap`)
      save        the old world's last step (or decision) -> its checkpoint row (0: none saved)
      rendezvous  -> the new worker's imports done (`imported`; of which `startup` from its process start)
      reshard     -> the new attempt's start row: process group, re-plan, build, checkpoint load + reshard
      warmup      -> its step WARMUP_STEPS, less that many steps at `steady_step_s` (the median after
                  them); `outside_steps_s` of it the step timers did not see (the attempt's set-up)
    `gap` is the wall time from the old world's last step to the new one's step WARMUP_STEPS: the
    phases and WARMUP_STEPS steady steps tile it.
    A change followed by another before its world's steady steps has `changed_again`, no warm-up."""
    steps = sorted((r for r in run.train + run.superseded if isinstance(r.get("time"), (int, float))),
                   key=lambda r: r["time"])
    timed = [e for e in run.events if isinstance(e.get("time"), (int, float))]
    changes = [e for e in timed if e.get("event") == "membership" and not e.get("resume")]
    out = []
    for i, m in enumerate(changes):
        at, step = m["time"], m["step"]
        prev = changes[i - 1]["time"] if i else float("-inf")
        following = changes[i + 1]["time"] if i + 1 < len(changes) else float("inf")
        excludes = [e for e in timed if e.get("event") == "exclude" and prev < e["time"] <= at]
        marks = [r["time"] for r in steps if r["time"] <= at]
        marks += [e["time"] for e in timed if e.get("event") in ("exclude", "start", "restart") and prev < e["time"] <= at]
        if not marks:
            continue
        begin = max(marks)  # the old world's last step, or the decision of an attempt that trained none
        saves = [c["time"] for c in run.checkpoints if isinstance(c.get("time"), (int, float)) and begin < c["time"] <= at]
        saved = saves[-1] if saves else begin
        starts = [e["time"] for e in timed if e.get("event") in ("start", "restart") and at <= e["time"] < following]
        started = starts[0] if starts else at
        imported = m.get("imported") if isinstance(m.get("imported"), (int, float)) else None
        if imported is not None and not saved <= imported <= started:
            imported = None  # another clock's record, or from a worker that was not this attempt's
        proc = m.get("worker_started") if imported is not None else None
        row = {"step": step, "begin_time": begin, "old_world": m.get("old_world"), "world": m.get("world"),
               "why": str(m.get("reason") or "").split(":")[0], "excluded": bool(excludes),
               "detection_s": _detection(run, excludes[-1], steps) if excludes else None,
               "save_s": saved - begin, "rendezvous_s": (imported if imported is not None else started) - saved,
               "startup_s": imported - min(max(proc, saved), imported) if isinstance(proc, (int, float)) else None,
               "reshard_s": started - imported if imported is not None else None,
               "warmup_s": None, "steady_step_s": None, "gap_s": None, "outside_steps_s": None, "changed_again": False}
        new = sorted((r for r in steps if started < r["time"] < following and r["step"] > step), key=lambda r: r["step"])
        first = [r for r in new if r["step"] <= step + WARMUP_STEPS]
        steady = [r["step_time_s"] for r in new[len(first):] if isinstance(r.get("step_time_s"), (int, float))]
        if not first or not steady:
            row["changed_again"] = following != float("inf")
            out.append(row)
            continue
        median = statistics.median(steady)
        n = first[-1]["step"] - step
        gap = first[-1]["time"] - begin
        warmup = first[-1]["time"] - started - n * median
        per_step = [r.get("step_time_s") for r in first]
        inside = None  # the part the step timers measured; the rest is set-up and logging between them
        if len(first) == n and all(isinstance(t, (int, float)) for t in per_step):
            inside = sum(per_step) - n * median
        row.update(warmup_s=warmup, steady_step_s=median, warmup_steps=n, gap_s=gap,
                   outside_steps_s=warmup - inside if inside is not None else None)
        out.append(row)
    return out


def world_over_time(run: Run) -> list[dict]:
    """The world size by attempt, merged where it did not change: seconds since the run's first
    row, the step it started from, ranks."""
    span = run.time_span()
    out: list[dict] = []
    for e in run.starts:
        if e.get("time") is None or not isinstance(e.get("world"), int):
            continue
        if out and out[-1]["world"] == e["world"]:
            continue
        out.append({"since_s": e["time"] - (span[0] if span else e["time"]), "step": e["step"], "world": e["world"]})
    return out
