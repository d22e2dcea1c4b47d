"""Text rendering of plans, explanations and goodput reports."""

from __future__ import annotations

import dataclasses

from ndtrain.model.config import PRESETS, num_params
from ndtrain.planner.compile_choice import compile_choice
from ndtrain.planner.accelerator import GiB
from ndtrain.planner.problem import Problem
from ndtrain.planner.refusal import refusal_lines
from ndtrain.planner.search import Prediction, SearchResult
from ndtrain.planner.uncertainty import headroom, moving_parts

MEM_KEYS = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead", "fragmentation")
COMM_KEYS = ("tp", "cp", "ep", "pp", "dp")


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}{unit}"
    return f"{n:.3g}{unit}"


def seconds(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def check_command(pb: Problem, lay) -> str:
    """The `ndtrain config check` line that builds this layout with the runtime's own checks."""
    cfg = pb.cfg
    if cfg.preset in PRESETS:
        model = [f"--model.preset={cfg.preset}"]
    else:
        model = [f"--model.{k}={getattr(cfg, k)}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                               "vocab_size", "n_experts", "n_active_experts",
                                                               "n_shared_experts", "expert_ffn_dim", "moe_dense_layers")
                 if getattr(cfg, k)] + [f"--model.max_seq_len={pb.seq}"]  # the planned length, not the planner's RoPE range
        model += ["--model.tie_embeddings=true"] if cfg.tie_embeddings else []
        model += [f"--model.mlp={cfg.mlp}"] if cfg.mlp != "swiglu" else []
    # the planned precision is the runtime's [parallel] mixed_precision (fp8: float8 matmuls, layout/fp8.py)
    lay = dataclasses.replace(lay, mixed_precision=pb.precision)
    return " ".join(["ndtrain config check", f"--world {pb.world}", *model, f"--data.seq_len={pb.seq}",
                     f"--train.global_batch={pb.global_batch}", *lay.override_args()])


def header(pb: Problem) -> str:
    cfg, hw = pb.cfg, pb.hw
    total, active = num_params(cfg), num_params(cfg, active_only=True)
    name = cfg.preset if cfg.preset != "custom" else f"custom {cfg.n_layers}x{cfg.dim}"
    params = human(total) + (f" ({human(active)} active)" if cfg.is_moe else "")
    return (f"{name}, {params} params, on {pb.world:,} x {hw.name} ({hw.description}); seq {pb.seq:,}, "
            f"global batch {pb.global_batch:,} seqs = {human(pb.tokens_per_step)} tokens; {pb.precision}, "
            f"stack {pb.stack.name}; " + ("layouts the ndtrain runtime builds" if pb.strict else
                                          "relaxed: also layouts only other runtimes build") +
            f"; MFU counts full s x s attention")


def robust_json(rob, p: Prediction) -> dict:
    """Interval and robustness fields of one layout for `--json` (empty without sampling)."""
    if rob is None:
        return {}
    lo, hi = rob.interval(p)
    mlo, mhi = rob.model_interval(p)
    return {"step_time_interval_s": [lo, hi], "step_time_interval_with_model_error_s": [mlo, mhi],
            "model_error_group": rob.error_group, "model_error_runs": len(rob.errors),
            "within_2pct_share": rob.share_within(p), "moving_parts": moving_parts(p)}


def _interval(rob, pred: Prediction, pb: Problem) -> str:
    if rob is None:
        return ""
    lo, hi = rob.interval(pred)
    tok = pb.tokens_per_step
    if not rob.errors:
        return f" ({human(tok / hi)}-{human(tok / lo)} over sampled constants)"
    mlo, mhi = rob.model_interval(pred)
    return (f" (80%: {human(tok / mhi)}-{human(tok / mlo)} with the model's error on {len(rob.errors)} published "
            f"{rob.error_group} runs; {human(tok / hi)}-{human(tok / lo)} over sampled constants alone)")


def layout_block(rank: str, pred: Prediction, pb: Problem, budget: float, rob=None) -> list[str]:
    t, mem = pred.time, pred.memory
    comm = ", ".join(f"{k} {seconds(t['comm'][k])}" for k in COMM_KEYS if t["comm"][k] > 5e-4)
    recompute = f" (recompute {seconds(t['recompute'])})" if t["recompute"] > 0 else ""
    fits = "" if pred.fits else "   DOES NOT FIT"
    where = mem["device"] + f" rank, {mem['layers']} layers"
    days = budget / pred.tokens_per_s / 86400
    mwh = pb.world * pb.hw.board_w * days * 86400 / 3.6e9
    compiled = compile_for_budget(pb, pred, budget)
    return [
        f"{rank} {pred.layout.short()}",
        f"    throughput {human(pred.tokens_per_s)} tokens/s{_interval(rob, pred, pb)}, {pred.tflops_per_gpu:.3g} TFLOP/s/GPU, "
        f"MFU {pred.mfu:.1%}, HFU {pred.hfu:.1%}" + (" (of the bf16 peak)" if pb.precision == "fp8" else ""),
        f"    step {seconds(pred.step_time)} = compute {seconds(t['compute'])}{recompute} + exposed comm "
        f"{seconds(t['exposed_comm'])}" + (f" ({comm})" if comm else "") +
        f" + bubble {seconds(t['bubble'])} + optimizer {seconds(t['optimizer'])}; "
        f"{t['micro_batches']} micro-batches",
        f"    memory {mem['total'] / GiB:.1f} of {pb.hw.hbm_bytes / GiB:.1f} GiB ({where}) = "
        + " + ".join(f"{k} {mem[k] / GiB:.1f}" for k in MEM_KEYS) + fits,
        f"    {human(budget)} tokens: {days:,.1f} days, {mwh:,.0f} MWh" if mwh >= 100 else
        f"    {human(budget)} tokens: {days:,.1f} days, {mwh:.3g} MWh"
        + (f" (GPUs at {pb.hw.power_w:.0f} W)" if pb.hw.power_w else " (GPUs at TDP)"),
    ] + ([f"    {compiled['description']}; `[parallel] compile_auto` decides so for a run this long"] if compiled else [])


def compile_for_budget(pb: Problem, pred: Prediction, budget: float) -> dict | None:
    """What `compile_auto` would decide for a run of `budget` tokens on this layout (its steps:
    the budget over the tokens per step); None where it cannot be priced."""
    return compile_choice(pb, pred.layout, max(1, round(budget / pb.tokens_per_step)))


def plan_text(pb: Problem, res: SearchResult, budget: float, explain: bool, rob=None,
              shown: list[Prediction] | None = None) -> str:
    shown = shown if shown is not None else res.top
    if res.considered == 1:
        lines = [header(pb), "the given layout:", ""]
    else:
        lines = [header(pb),
                 f"searched {res.considered:,} layouts in {res.seconds:.2f} s: {res.sized:,} sized, {res.fitting:,} fit "
                 f"in memory, {res.evaluated:,} timed (the rest were dominated or bounded out)", ""]
    if not res.top:
        lines += refusal_lines(pb, res)  # the rule or refusal that emptied the search, and what lifts it
        if res.fastest_over_cap:
            lines += layout_block("closest:", res.fastest_over_cap, pb, budget)
        return "\n".join(lines)
    for i, pred in enumerate(shown, 1):
        lines += layout_block(f"#{i}", pred, pb, budget, rob) + [""]
    if rob is not None and res.considered > 1:
        lines += [robust_line(rob), ""]
    if pb.strict:
        lines += ["check #1 with the runtime's own rules, no GPU needed:", "  " + check_command(pb, shown[0].layout), ""]
    if explain:
        lines += explain_text(pb, res, shown[0], rob)
    return "\n".join(lines).rstrip()


def robust_line(rob) -> str:
    n = len(rob.candidates)
    text = (f"robustness: #1 is within 2% of the best of {n} candidates in {rob.share:.0%} of {rob.worlds} sampled "
            f"worlds (every constant drawn over its range, docs/planner.md)")
    if rob.chosen.layout != rob.nominal.layout:
        text += "; it is not the nominal fastest (--explain says why)"
    return text


def _components(p: Prediction) -> dict:
    t = p.time
    out = {"compute": t["compute"] - t["recompute"], "recompute": t["recompute"], "bubble": t["bubble"],
           "optimizer": t["optimizer"]}
    out.update({f"{k} comm": t["comm"][k] for k in COMM_KEYS})
    return out


def versus_winner(win: Prediction, other: Prediction) -> str:
    a, b = _components(win), _components(other)
    deltas = sorted(((b[k] - a[k], k) for k in a), key=lambda d: -abs(d[0]))
    diff = [f"{k} {'+' if d >= 0 else '-'}{seconds(abs(d))}" for d, k in deltas if abs(d) > 1e-3 * win.step_time][:4]
    wl, ol = win.layout.as_dict(), other.layout.as_dict()
    changed = [f"{k} {wl[k]}->{ol[k]}" for k in wl if wl[k] != ol[k]]
    gap = other.step_time - win.step_time
    speed = f"{seconds(gap)} slower" if gap >= 0 else f"{seconds(-gap)} faster at nominal constants"
    return (f"{other.layout.short()}: {speed} per step "
            f"({abs(other.step_time / win.step_time - 1):.2%}); differs in {', '.join(changed) or 'nothing'}; "
            f"time moves: {', '.join(diff) or 'none above 0.1%'}")


def explain_text(pb: Problem, res: SearchResult, win: Prediction | None = None, rob=None) -> list[str]:
    win = win or res.top[0]
    lines = ["why the others lost:"]
    ranked = rob.ranked(res.top) if rob else res.top
    runner = next((p for p in ranked if p.layout != win.layout), None)
    if runner:
        lines.append("  runner-up " + versus_winner(win, runner))
    mesh = (win.layout.tp, win.layout.cp, win.layout.pp, win.layout.ep)
    others = sorted((p for m, p in res.best_by_mesh.items() if m != mesh and (runner is None or p.layout != runner.layout)),
                    key=lambda p: p.step_time)
    for p in others[:3]:
        lines.append("  best other mesh " + versus_winner(win, p))
    if rob is not None:
        lines += robust_explain(pb, rob)
    if res.fastest_over_cap:
        o = res.fastest_over_cap
        lines.append(f"  faster but too big: {o.layout.short()} would take {seconds(o.step_time)} but needs "
                     f"{o.memory['total'] / GiB:.1f} GiB > {pb.hw.hbm_bytes / GiB:.1f} GiB "
                     f"(activations {o.memory['activations'] / GiB:.1f} GiB)")
    return lines


def goodput_text(r: dict) -> str:
    lines = [f"{r['gpus']:,} GPUs: job MTBF {r['mtbf_job_s'] / 3600:.2f} h ({r['failures_per_day']:.1f} "
             f"interruptions/day); checkpoint save {r['ckpt_s'] / 60:.2f} min, restart {r['restart_s'] / 60:.2f} min",
             f"{'interval rule':<16}{'interval':>12}{'expected':>11}{'simulated':>20}   failures/run",
             ]
    for row in r["rows"]:
        sim = row["simulated"]
        simulated = f"{sim['efficiency']:>13.2%} ± {sim['stderr']:.2%}   {sim['failures']:.0f}" if sim else f"{'-':>20}"
        lines.append(f"{row['name']:<16}{row['interval_s'] / 60:>8.1f} min{row['expected']:>11.2%}{simulated}")
    lines.append(f"expected = Daly's closed form; simulated = {r['trials']} Monte-Carlo runs of "
                 f"{r['work_days']:g} days of work each")
    if r.get("exclusion"):
        x = r["exclusion"]
        pays = (f"excluding pays for itself when more than {x['breakeven_s'] / 60:.1f} min of training is left"
                if x["breakeven_s"] is not None else "excluding never pays for itself: wait, or replace the host")
        detected = f" after {x['detect_s']:.0f} s at the slow pace" if x.get("detect_s") else ""
        lines.append(f"a host {x['slowdown']:.0%} slow of {x['hosts']}: kept, the job trains at {x['keep_speed']:.1%}; "
                     f"excluded{detected} ({x['exclude_cost_s']:.0f} s lost), at {x['excluded_speed']:.1%}; {pays}")
    if r.get("exclusion_job"):
        j = r["exclusion_job"]

        def days(seconds: float, sim: dict | None) -> str:
            s = f" ({sim['wall'] / 86400:.3f} ± {sim['stderr'] / 86400:.3f} simulated)" if sim else ""
            return f"{seconds / 86400:.3f} days{s}"

        winner = "excluding" if j["saved_s"] > 0 else "keeping the host"
        lines.append(f"over {j['work_days']:g} days of work left, with the failures above: keep {days(j['keep_wall_s'], j['keep_simulated'])}, "
                     f"exclude {days(j['exclude_wall_s'], j['exclude_simulated'])}; {winner} finishes "
                     f"{abs(j['saved_s']) / 3600:.1f} h ({abs(j['saved_s']) / max(j['keep_wall_s'], j['exclude_wall_s']):.1%}) sooner")
    return "\n".join(lines)


def robust_explain(pb: Problem, rob) -> list[str]:
    """Why near-equals are ranked as they are: which overlap the nominal winner, and the choice."""
    lines = []
    if rob.reason:
        lines.append(f"  #1 {rob.reason}")
    elif rob.overlapping:
        lines.append(f"  #1 is the nominal fastest; of those whose intervals overlap it, none has fewer moving parts "
                     f"({len(moving_parts(rob.chosen))}) with as much headroom ({headroom(pb, rob.chosen) / GiB:.1f} GiB)")
    else:
        lines.append(f"  #1 is the nominal fastest and no other candidate's interval overlaps it")
    for c, faster in [(c, f) for c, f in rob.overlapping if c.layout != rob.chosen.layout][:3]:
        lo, hi = rob.interval(c)
        lines.append(f"  overlaps: {c.layout.short()} (faster in {faster:.0%} of worlds; step {lo:.2f}-{hi:.2f} s; "
                     f"{len(moving_parts(c))} moving parts; {headroom(pb, c) / GiB:.1f} GiB headroom)")
    return lines
