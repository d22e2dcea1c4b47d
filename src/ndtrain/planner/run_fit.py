"""Fitting a hardware profile to the user's own runs (`ndtrain calibrate --from-run`): pure
arithmetic over what runs measured, torch-free, so a profile fitted on a laptop from a cluster's
run directories plans for that cluster.

A run's step is priced by the time model in three groups of constants, and the fit scales each
group by one factor (a "knob"), in the profile itself, so what is written is an ordinary profile
that `plan --profile` and the trainer's planner read as they read any other:
  compute   the rates of the FLOPs and bytes: CPU matmul and attention rates and copy bandwidth;
            a GPU's gemm_eff, fp8_gemm_eff, attn_eff and hbm_eff (divided by the knob)
  overhead  the work beside the FLOPs: CPU host time per layer and per op, the optimizer, a
            pipeline action's bookkeeping; a GPU's elementwise traffic (kappa_*, fp8_cast_bytes)
  comm      every collective: CPU alpha-beta fits (idle and in situ), the TP host cost; a GPU's
            link efficiencies and latencies and its measured fits (times multiplied by the knob)
Knob j is exp(g + e_j): g, one speed shared by all three (a loaded host, a power-capped GPU), is
left free, and each e_j is held near 0 by a prior of width PRIOR_SPREAD. One run fits g, so
every group moves together and a layout with another mix of compute and traffic moves with it;
runs of layouts with different mixes separate the e_j. A group no run exercises (comm on one
rank) keeps the shared factor. Residuals are log(predicted / measured) step times, at the spread
MEASURE_SPREAD a step median keeps from run to run.

Compile (CPU ranks): priced only where measured. A compiled run fitted with an eager twin (its
layout uncompiled, same model and batch) gives the cold compile and the saving (compile_figures);
without one a profile that did not price compile says so (`unmeasured.compile`), and compile_auto
stays off rather than pricing the defaults of another host as this one's.

Memory: on CPU ranks the peak resident set includes the Python and torch runtime, which the model
holds in `overhead_gib`: the fit is the median of what the runs' peaks leave above the modelled
states and activations. A GPU run's peak is the allocator's, which holds neither the CUDA context
nor the fragmentation: it is compared, not fitted.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout
from ndtrain.model.config import ModelConfig
from ndtrain.planner import constants as consts
from ndtrain.planner import profile as profiles
from ndtrain.planner.accelerator import GiB, Hardware
from ndtrain.planner.hardware import COLLECTIVES, UNMEASURED_TP_HOST, from_profile, get_hardware
from ndtrain.planner.layer import OPS_HEAD, OPS_PER_LAYER
from ndtrain.planner.timing import OPTIMIZER_BYTES_PER_PARAM

KNOBS = ("compute", "overhead", "comm")
# How far one group may sit from the shared factor before the data must say so: a factor of 1.5
# (log 1.5 = 0.41); the shared factor itself is free (its prior is a factor of 1000, LOG_FREE).
PRIOR_SPREAD = math.log(1.5)
LOG_FREE = math.log(1000.0)
# A step median's spread between runs of one layout on one host: ~5% quiet, ~15% on a shared one.
MEASURE_SPREAD = 0.10
KNOB_RANGE = (1 / 50, 50.0)  # beyond this a fit is wrong, not a host

GPU_GROUPS = {"compute": ("gemm_eff", "fp8_gemm_eff", "attn_eff", "hbm_eff"),
              "overhead": ("kappa_eager", "kappa_fused", "fp8_cast_bytes"),
              "comm_eff": ("nvlink_eff", "nic_eff"), "comm_latency": ("alpha_intra", "alpha_inter")}
# Why a profile fitted to runs prices no compile (hardware.py: `unmeasured.compile`; compile_auto's line)
COMPILE_UNMEASURED = ("compile not measured: this profile was fitted to runs without a compiled and an eager "
                      "run of one layout, over a profile that did not price it (fit such a pair, or run "
                      "`ndtrain calibrate`)")


@dataclass(frozen=True)
class Observation:
    """What one run measured, with what the time model needs to price it."""
    label: str
    cfg: ModelConfig
    layout: Layout  # resolved: every degree a number
    seq: int
    global_batch: int
    world: int
    precision: str
    step_s: float  # median step past warm-up
    peak_bytes: float | None = None  # the fullest rank's peak (CPU: resident set; GPU: allocator)
    first_step_s: float | None = None  # the last attempt's first step (a compiled run's cold compile in it)


@dataclass
class Fit:
    profile: dict  # the fitted profile, ready to write
    knobs: dict  # {group: factor on its time}
    rows: list = field(default_factory=list)  # per run: label, layout, measured, before, after (s; bytes)


# ---- the profile with its groups scaled ---------------------------------------------------

def hardware(data: dict, source: str = "") -> Hardware:
    """The Hardware a profile dict describes (a GPU profile over its catalog entry)."""
    if profiles.is_gpu(data):
        return profiles.apply(get_hardware(data.get("catalog", "")), data, source or "fitted profile")
    return from_profile(data, source)


def _scale_fit(fit: dict, t: float) -> dict:
    """An alpha-beta fit whose times are t times longer."""
    out = dict(fit)
    out["alpha"] = fit["alpha"] * t
    out["beta"] = fit["beta"] / t
    if "by_world" in fit:
        out["by_world"] = {w: _scale_fit(f, t) for w, f in fit["by_world"].items()}
    return out


def _scale_cpu(data: dict, k: dict) -> dict:
    """Every figure the CPU model prices written out (defaults included, so a scaled default is a
    number in the file) and scaled by its group's knob."""
    hw = from_profile(data)
    out = copy.deepcopy(data)
    out.pop("host_probe", None)  # fitted to runs: a calibration, no longer the probe's rates alone
    c, h, d = k["compute"], k["overhead"], k["comm"]
    matmul = {**{n: v for n, v in out.get("matmul", {}).items() if isinstance(v, (int, float))},
              "fp32_1thread": hw.peak_fp32, "bf16_1thread": hw.peak_bf16}
    out["matmul"] = {n: v / c for n, v in matmul.items()}
    out["attention"] = {p: {s: r / c for s, r in rates.items()} for p, rates in hw.attn_flops.items()}
    out["memory"] = {**out.get("memory", {}), "copy_bw": hw.hbm_bw / c, "bytes_per_device": hw.hbm_bytes}
    out["cores"], out["devices_per_node"] = hw.cores, hw.gpus_per_node
    out["op_overhead_s"] = hw.op_overhead_s * h
    host = dict(out.get("host_s", {}))
    host["layer"] = (hw.layer_overhead_s or OPS_PER_LAYER * hw.op_overhead_s) * h
    host["head"] = (hw.head_overhead_s or OPS_HEAD * hw.op_overhead_s) * h
    out["host_s"] = host
    out["optimizer_s_per_param"] = (hw.optimizer_s_per_param or OPTIMIZER_BYTES_PER_PARAM / hw.hbm_bw) * h
    out["pp_action_s"] = hw.pp_action_s * h
    if hw.compile_s <= 0:  # no longer a probe's profile, but compile is as unmeasured as it was
        out["unmeasured"] = {**out.get("unmeasured", {}), "compile": hw.compile_unmeasured or COMPILE_UNMEASURED}
    colls = out.get("collectives", {})
    # the defaults from_profile fills in (reduce-scatter as the all-to-all it runs as) made explicit
    out["collectives"] = {n: _scale_fit(colls.get(n) or hw.collectives[n], d) for n in COLLECTIVES}
    out["dp_in_situ"] = {w: {n: (f if n == "measured" else _scale_fit(f, d)) for n, f in fits.items()}
                         for w, fits in out.get("dp_in_situ", {}).items()}
    tp = out.get("tp_host", UNMEASURED_TP_HOST)
    out["tp_host"] = {w: {t: {**v, **{part: {"alpha": v[part]["alpha"] * d, "per_byte": v[part]["per_byte"] * d}
                                          for part in ("layer", "head")}} for t, v in by_tp.items()}
                      for w, by_tp in tp.items()}
    return out


def _scale_gpu(data: dict, k: dict) -> dict:
    out = copy.deepcopy(data)
    gen = get_hardware(data.get("catalog", "")).generation
    known = consts.resolve(gen, {n: v for n, v in data.get("constants", {}).items()
                                 if n in consts.entries(gen)})
    factor = {"compute": 1 / k["compute"], "overhead": k["overhead"], "comm_eff": 1 / k["comm"],
              "comm_latency": k["comm"]}
    constants = dict(out.get("constants", {}))
    for group, names in GPU_GROUPS.items():
        for name in names:
            if name in known and known[name]:
                constants[name] = known[name] * factor[group]
    out["constants"] = constants
    out["collectives"] = {n: _scale_fit(f, k["comm"]) for n, f in out.get("collectives", {}).items() if "alpha" in f}
    return out


def scaled(data: dict, knobs: dict) -> dict:
    """The profile `data` with each group's times multiplied by its knob."""
    k = {g: float(knobs.get(g, 1.0)) for g in KNOBS}
    return _scale_gpu(data, k) if profiles.is_gpu(data) else _scale_cpu(data, k)


# ---- pricing a run ---------------------------------------------------------------------------

def predict_run(hw: Hardware, obs: Observation):
    """The planner's Prediction for the layout the run ran (raises NdtrainError, naming the run,
    where the time model cannot price it)."""
    from ndtrain.planner.api import _precision
    from ndtrain.planner.problem import make_problem
    from ndtrain.planner.search import Evaluator

    try:
        pb = make_problem(obs.cfg, obs.seq, obs.global_batch, obs.world, hw, precision=_precision(hw, obs.precision),
                          strict=False)
        return Evaluator(pb)(obs.layout)
    except NdtrainError as exc:
        raise NdtrainError(f"run {obs.label}: the planner cannot price its layout: {exc}") from None


def model_memory(pred, hw: Hardware) -> float:
    """The predicted peak without what `overhead` stands for (CPU: the runtime; GPU: also the
    allocator's slack, which its allocated peak never shows)."""
    mem = pred.memory
    if hw.generation == "cpu":
        return mem["total"] - mem.get("overhead", 0.0)
    return mem["total"] - mem.get("overhead", 0.0) - mem.get("fragmentation", 0.0)


# ---- the fit -------------------------------------------------------------------------------

def _knobs(theta: list[float]) -> dict:
    lo, hi = KNOB_RANGE
    return {g: min(hi, max(lo, math.exp(theta[0] + theta[1 + i]))) for i, g in enumerate(KNOBS)}


def _residuals(base: dict, obs: list[Observation], theta: list[float]) -> list[float]:
    hw = hardware(scaled(base, _knobs(theta)))
    res = [math.log(predict_run(hw, o).step_time / o.step_s) / MEASURE_SPREAD for o in obs]
    return res + [theta[0] / LOG_FREE] + [e / PRIOR_SPREAD for e in theta[1:]]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small, regularised, well-posed system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[col][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


def fit_knobs(base: dict, obs: list[Observation], iterations: int = 30) -> dict:
    """Levenberg-Marquardt on log step times (numerical derivatives: the time model has maxima
    and branches, and four parameters cost a few dozen predictions per run)."""
    theta, lam, eps = [0.0] * (1 + len(KNOBS)), 1e-3, 1e-4
    res = _residuals(base, obs, theta)
    cost = sum(r * r for r in res)
    for _ in range(iterations):
        jac = []
        for j in range(len(theta)):
            bumped = theta[:]
            bumped[j] += eps
            jac.append([(x - y) / eps for x, y in zip(_residuals(base, obs, bumped), res)])
        jtj = [[sum(a * b for a, b in zip(jac[i], jac[j])) for j in range(len(theta))] for i in range(len(theta))]
        jtr = [sum(a * r for a, r in zip(jac[i], res)) for i in range(len(theta))]
        while True:
            damped = [[v * (1 + lam) if i == j else v for j, v in enumerate(row)] for i, row in enumerate(jtj)]
            step = _solve(damped, [-x for x in jtr])
            trial = [t + s for t, s in zip(theta, step)]
            trial_res = _residuals(base, obs, trial)
            trial_cost = sum(r * r for r in trial_res)
            if trial_cost < cost or lam > 1e6:
                break
            lam *= 10
        if trial_cost >= cost:
            break
        converged = cost - trial_cost < 1e-9 * max(1.0, cost)
        theta, res, cost, lam = trial, trial_res, trial_cost, max(lam / 10, 1e-7)
        if converged:
            break
    return _knobs(theta)


def _eager_twin(o: Observation, obs: list[Observation]) -> Observation | None:
    """The run of o's layout, model and batch that ran eager, if one was fitted with it."""
    eager = dataclasses.replace(o.layout, compile=False)
    return next((e for e in obs if e.layout == eager and (e.cfg, e.seq, e.global_batch, e.world, e.precision)
                 == (o.cfg, o.seq, o.global_batch, o.world, o.precision)), None)


def compile_figures(data: dict, obs: list[Observation]) -> dict:
    """What compiled CPU runs measured of compile beside an eager run of their layout (else {}):
    `compile_s`, the cold compile of one kind of block (the compiled run's first step over its
    median, less the eager one's), and `compile_saving`, the fraction of a layer that makes the
    planner's compiled/eager step ratio on `data` the measured one."""
    from ndtrain.planner.api import _precision

    plain = {k: v for k, v in data.items() if k != "unmeasured"}
    colds, savings, labels = [], {}, []
    for o in obs:
        e = _eager_twin(o, obs) if o.layout.compile else None
        if e is None or o.first_step_s is None or e.first_step_s is None:
            continue
        kinds = len({o.cfg.is_moe_layer(i) for i in range(o.cfg.n_layers)})
        cold = ((o.first_step_s - o.step_s) - (e.first_step_s - e.step_s)) / kinds
        precision = _precision(hardware(plain), o.precision).replace("fp8", "bf16")
        eager_s = predict_run(hardware(plain), e).step_time

        def ratio(s: float) -> float:
            hw = hardware({**plain, "compile_s": 1.0, "compile_saving": {precision: s}})
            return predict_run(hw, o).step_time / eager_s

        target, lo, hi = o.step_s / e.step_s, 0.0, 0.95
        for _ in range(30):  # the predicted ratio falls as the saving grows
            lo, hi = ((lo + hi) / 2, hi) if ratio((lo + hi) / 2) > target else (lo, (lo + hi) / 2)
        colds.append(max(cold, 1e-3))  # a warm inductor cache: cheap, yet measured (0 means unknown)
        savings.setdefault(precision, []).append((lo + hi) / 2)
        labels.append(o.label)
    if not colds:
        return {}
    return {"compile_s": statistics.median(colds), "compile_measured_by": labels,
            "compile_saving": {p: statistics.median(v) for p, v in savings.items()}}


def fit(base: dict, obs: list[Observation], description: str = "") -> Fit:
    """The profile `base` fitted to the runs `obs`: its three groups scaled, and (CPU) the
    runtime's memory in `overhead_gib` where the runs recorded their peaks. A profile that is
    itself a fit is fitted again from the profile it came from (kept in it, `base_profile`):
    the same runs give the same profile however often they are fitted, and the measured
    calibration a fit started from is never lost."""
    if not obs:
        raise NdtrainError("calibrate --from-run: no run to fit")
    start = base.get("from_runs", {}).get("base_profile") or base
    eager = [o for o in obs if not o.layout.compile]
    knobs = fit_knobs(start, eager or obs)
    if not profiles.is_gpu(start) and (figures := compile_figures(scaled(start, knobs), obs)):
        # compiled runs beside eager ones measured compile: price it from them, and refit with it
        rest = {k: v for k, v in start.get("unmeasured", {}).items() if k != "compile"}
        start = {k: v for k, v in {**start, **figures}.items() if k != "unmeasured"} | (
            {"unmeasured": rest} if rest else {})
        knobs = fit_knobs(start, obs)
    elif eager and eager != obs:
        knobs = fit_knobs(start, obs)
    prof = scaled(start, knobs)
    before_hw, after_hw = hardware(base), hardware(prof)  # before: what the caller planned with
    peaks = [o for o in obs if o.peak_bytes]
    if peaks and not profiles.is_gpu(start):
        left = [o.peak_bytes - model_memory(predict_run(after_hw, o), after_hw) for o in peaks]
        prof["overhead_gib"] = max(0.05, statistics.median(left) / GiB)
        after_hw = hardware(prof)
    rows = []
    # set beside what a run records: a CPU rank's whole resident set, a GPU's allocated peak
    shown = (lambda p, hw: model_memory(p, hw)) if profiles.is_gpu(start) else (lambda p, hw: p.memory["total"])
    for o in obs:
        before, after = predict_run(before_hw, o), predict_run(after_hw, o)
        rows.append({"label": o.label, "layout": o.layout.short(), "world": o.world, "precision": o.precision,
                     "measured_s": o.step_s, "before_s": before.step_time, "after_s": after.step_time,
                     "measured_bytes": o.peak_bytes, "before_bytes": shown(before, before_hw),
                     "after_bytes": shown(after, after_hw)})
    prof["from_runs"] = {"knobs": knobs, "runs": [{k: r[k] for k in ("label", "layout", "world", "measured_s")}
                                                  for r in rows], "base": description,
                         "base_profile": copy.deepcopy(start)}
    if profiles.is_gpu(start):
        prof["calibrated"] = f"{start.get('calibrated', '')} fitted to {len(obs)} run(s)".strip()
    else:
        prof["description"] = f"{start.get('description') or 'this machine'}; fitted to {len(obs)} run(s)"
    return Fit(profile=prof, knobs=knobs, rows=rows)
