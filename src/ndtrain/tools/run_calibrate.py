"""`ndtrain calibrate --from-run RUN_DIR [RUN_DIR ...]`: the hardware profile fitted to what real
runs measured (planner/run_fit.py fits; this module reads the run directories and writes the
profile). Torch-free: run directories copied off a cluster fit its profile on any machine.

A run gives the layout it ran (config.toml, the world from its start row), its median step past
warm-up and its peak memory (metrics.jsonl). The profile written is the one `plan --profile`
reads: on CPU the this-machine profile (the calibration's, else the host probe's rates), on a
GPU (`--gpu NAME`, or a GPU `--profile`) the catalog entry's constants.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ndtrain.errors import NdtrainError, UsageError
from ndtrain.planner import profile as profiles
from ndtrain.planner import run_fit
from ndtrain.tools.run_data import Run, read_run

MIN_STEPS = 5  # timed steps past the 3 of warm-up that Run.timed_rows drops


def observe(run: Run) -> run_fit.Observation:
    """What `run` measured and ran, or one line naming the run and what it lacks."""
    from ndtrain.config import from_dict
    from ndtrain.layout import fill_degrees, from_config

    where = str(run.path)
    if not run.config:
        raise NdtrainError(f"{where}: no config.toml: the run's layout is not known")
    try:
        cfg = from_dict(run.config)
    except NdtrainError as exc:
        raise NdtrainError(f"{where}/config.toml: {exc}") from None
    timed = run.timed_rows()
    if len(timed) < MIN_STEPS:
        raise NdtrainError(f"{where}: {len(timed)} timed step(s) past warm-up in metrics.jsonl; a fit needs "
                           f"{MIN_STEPS} (train at least {MIN_STEPS + 3} steps)")
    world = run.world()
    if not isinstance(world, int) or world < 1:
        raise NdtrainError(f"{where}: metrics.jsonl has no start row with the world size")
    try:
        lay = fill_degrees(from_config(cfg.parallel, cfg.train, cfg.data), world)
    except NdtrainError as exc:
        raise NdtrainError(f"{where}: its layout does not resolve for world {world}: {exc}") from None
    first = run.starts[-1]["step"] if run.starts else 0  # the last attempt's peaks
    peaks = [max(r["rank_peak_memory_mb"]) for r in run.ranks if r["step"] > first
             and isinstance(r.get("rank_peak_memory_mb"), list) and r["rank_peak_memory_mb"]]
    peaks += [r["peak_memory_mb"] for r in run.train if r["step"] > first and
              isinstance(r.get("peak_memory_mb"), (int, float))]
    firsts = [r["step_time_s"] for r in run.train if r["step"] == first + 1 and "step_time_s" in r]
    return run_fit.Observation(
        first_step_s=firsts[0] if firsts else None, label=run.label, cfg=cfg.model, layout=lay, seq=cfg.data.seq_len, global_batch=cfg.train.global_batch,
        world=world, precision=lay.mixed_precision, step_s=run.measured_step_time(),
        peak_bytes=max(peaks) * 2**20 if peaks else None)


# A CPU run whose wall step is this many times its CPU time waited for more than its collectives:
# on the 2-core host of docs/calibrate-from-runs.md, shared with other jobs, it was 4-8x.
BUSY_HOST_RATIO = 2.0


def busy_host(run: Run) -> float | None:
    """The median wall step over the median CPU seconds of the step (`step_cpu_s`, all of the
    process's threads), where that says the host was busy with other work; else None."""
    import statistics

    rows = [r for r in run.timed_rows() if r.get("step_cpu_s") and r.get("step_time_s")]
    if not rows:
        return None
    ratio = statistics.median(r["step_time_s"] for r in rows) / statistics.median(r["step_cpu_s"] for r in rows)
    return ratio if ratio >= BUSY_HOST_RATIO else None


def base_profile(profile: str | None, gpu: str | None) -> tuple[dict, str]:
    """(the profile the fit starts from, where it came from)."""
    from ndtrain.planner.hardware import DEFAULT_PROFILE, get_hardware, host_probe
    from ndtrain.planner.host_cache import as_profile

    if profile:
        data = profiles.read_profile(profile)
        if gpu and not profiles.is_gpu(data):
            raise UsageError(f"--profile {profile} is a CPU profile; --gpu {gpu} fits a GPU's")
        if gpu and data.get("catalog") not in (None, get_hardware(gpu).name):
            raise UsageError(f"--profile {profile} was measured on {data.get('catalog')}, not {gpu}")
        return data, str(profile)
    if gpu:
        hw = get_hardware(gpu)
        if hw.generation == "cpu":
            raise UsageError(f"--gpu {gpu}: not a GPU (omit --gpu to fit this machine's CPU profile)")
        return {"kind": "gpu", "version": profiles.VERSION, "catalog": hw.name, "constants": {},
                "collectives": {}}, f"catalog {hw.name}"
    if Path(DEFAULT_PROFILE).is_file():
        return profiles.read_profile(DEFAULT_PROFILE), str(DEFAULT_PROFILE)
    probe = host_probe()
    if probe is not None:
        return as_profile(probe), "host probe"
    return {}, "defaults"


def check_profile_out(out: Path) -> None:
    """The fit may replace a hardware profile, never anything else (a run's metrics, a config)."""
    from ndtrain.paths import check_output_file

    check_output_file(out, "--out")
    if not out.exists():
        return
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict) or not ({"matmul", "collectives", "kind", "from_runs", "host_probe"} & set(data)):
        raise NdtrainError(f"--out {out}: exists and is not a hardware profile; refusing to overwrite it")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _err(pred: float, measured: float) -> str:
    return f"{100 * (pred / measured - 1):+.0f}%"


def fit_table(rows: list[dict]) -> list[str]:
    w = max([34] + [len(r["layout"]) for r in rows])  # a layout is never cut: the column fits the longest
    lines = [f"  {'run':<20} {'layout':<{w}} {'measured':>9} {'before':>16} {'after':>16}   "
             f"memory measured/before/after (MiB)"]
    for r in rows:
        mem = "-" if not r["measured_bytes"] else "/".join(
            f"{r[k] / 2**20:.0f}" for k in ("measured_bytes", "before_bytes", "after_bytes"))
        lines.append(f"  {r['label'][:20]:<20} {r['layout']:<{w}} {_ms(r['measured_s']):>6} ms "
                     f"{_ms(r['before_s']):>7} ms {_err(r['before_s'], r['measured_s']):>5} "
                     f"{_ms(r['after_s']):>7} ms {_err(r['after_s'], r['measured_s']):>5}   {mem}")
    return lines


def main(argv: list[str]) -> int:
    from ndtrain.planner.hardware import DEFAULT_PROFILE

    p = argparse.ArgumentParser(prog="ndtrain calibrate --from-run", description=__doc__.split("\n\n")[0])
    p.add_argument("--from-run", nargs="+", required=True, metavar="RUN_DIR", help="run directories to fit")
    p.add_argument("--profile", help="the profile to start from (default: this machine's, else its host probe)")
    p.add_argument("--gpu", help="the runs ran on this catalog GPU (h100, a100-80, ...): fit its constants")
    p.add_argument("--out", help=f"profile to write (default {DEFAULT_PROFILE}; with --gpu, gpu.json beside it)")
    args = p.parse_args(argv)
    if args.out:
        out = Path(args.out).expanduser()
    else:
        gpu = bool(args.gpu) or bool(args.profile and profiles.is_gpu(profiles.read_profile(args.profile)))
        out = Path(DEFAULT_PROFILE).with_name("gpu.json") if gpu else Path(DEFAULT_PROFILE)
    check_profile_out(out)
    base, source = base_profile(args.profile, args.gpu)
    runs = [read_run(d) for d in args.from_run]
    observations = [observe(r) for r in runs]
    result = run_fit.fit(base, observations, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")  # a reader never sees half a profile
    try:
        tmp.write_text(json.dumps(result.profile, indent=1))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    knobs = ", ".join(f"{g} x{v:.2f}" for g, v in result.knobs.items())
    print(f"wrote {out}: {source} fitted to {len(observations)} run(s); times scaled: {knobs}")
    if "overhead_gib" in result.profile:
        print(f"  runtime memory beside the model: {result.profile['overhead_gib']:.2f} GiB per rank")
    print("\n".join(fit_table(result.rows)))
    prof = result.profile
    if prof.get("compile_measured_by"):
        print(f"  compile measured by {', '.join(prof['compile_measured_by'])}: a cold compile of "
              f"{prof['compile_s']:.1f} s per kind of block; compiled blocks save " + ", ".join(
                  f"{100 * v:.0f}% of a layer ({p})" for p, v in prof["compile_saving"].items()))
    elif "compile" in prof.get("unmeasured", {}):
        print(f"  {prof['unmeasured']['compile']}: compile_auto leaves compile off with this profile")
    lo, hi = run_fit.KNOB_RANGE
    if any(not lo * 1.01 < v < hi / 1.01 for v in result.knobs.values()):
        print(f"  note: a factor reached the edge of its range ({lo:g}-{hi:g}x): the runs and the model disagree "
              f"beyond what scaling explains (the wrong --gpu, or a run that stalled)")
    if not profiles.is_gpu(base):
        busy = {r.label: x for r in runs if (x := busy_host(r)) is not None}
        if busy:
            print("  note: the host was busy with other work: wall steps were " + ", ".join(
                f"{x:.1f}x" for x in busy.values()) + f" the CPU time in {', '.join(busy)}; the profile prices "
                "that load, and plans for a quiet host will be pessimistic")
    print(f"  plan with it: ndtrain plan ... --profile {out}" + (f" --gpu {base.get('catalog')}" if profiles.is_gpu(base) else ""))
    return 0


def predicted_vs_measured(run: Run, profile: str | None = None) -> str:
    """The report's line: the planner's step for the layout the run ran, on the profile it would
    plan with now, beside the measured step."""
    try:
        obs = observe(run)
        base, source = base_profile(profile, None)
        pred = run_fit.predict_run(run_fit.hardware(base, source), obs)
    except NdtrainError as exc:
        return f"- ({exc})"
    return (f"predicted {pred.step_time:.3f} s/step, measured {obs.step_s:.3f} "
            f"({_err(pred.step_time, obs.step_s)}) on {source}")
