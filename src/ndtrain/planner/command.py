"""`ndtrain plan` and `ndtrain goodput`. No torch import: runs on a laptop."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from ndtrain.errors import NdtrainError
from ndtrain.planner.goodput import exclusion, goodput_report, price_exclusion
from ndtrain.layout import parse_items, parse_layout
from ndtrain.layout.schedules import NAMES as SCHEDULES
from ndtrain.layout.schedules import canonical_schedule
from ndtrain.planner.problem import make_problem
from ndtrain.planner.stack import PLANNED_AC, PRECISIONS, STACKS
from ndtrain.planner.refusal import refusal_lines
from ndtrain.planner.report import check_command, compile_for_budget, goodput_text, plan_text, robust_json
from ndtrain.planner.search import Evaluator, SearchResult, search
from ndtrain.planner.shapes import parse_count, parse_duration, resolve_model
from ndtrain.planner.uncertainty import assess

DEFAULT_TOKENS = "1T"  # the budget that days and energy are priced for when --tokens is not given
# `--network` keys -> (Hardware field, scale)
NETWORK_KEYS = {"nvlink": ("gpus_per_node", 1), "pod": ("pod_gpus", 1), "oversub": ("oversubscription", 1.0),
                "nic": ("nic_bw", 1e9)}


def _count(text: str, binary: bool = False) -> float:
    try:
        return parse_count(text, binary)
    except ValueError as exc:
        raise NdtrainError(str(exc)) from exc


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ndtrain plan", description="Predict memory, step time, MFU and energy of parallel "
                "layouts and pick the fastest that fits.")
    p.add_argument("--model", help="preset name (e.g. llama3-8b, deepseek-v3)")
    p.add_argument("--model-shape", help="layers=,hidden=,heads=,kv_heads=,ffn=,vocab=,mlp=swiglu|gelu "
                   "[,experts=,active_experts=,shared_experts=,expert_ffn=,dense_layers=]")
    p.add_argument("--gpus", required=True, help="GPU count (with --gpu), or a mixed pool of COUNTxKIND items: "
                   "64xh100,64xa100 (planned by batch and stage shares against the uniform split and the best "
                   "one-kind subset)")
    p.add_argument("--gpu", default="h100", help="a100-40, a100-80, h100, h200, b200, h800, this-machine")
    p.add_argument("--profile", help="calibration profile from `ndtrain calibrate`: this-machine's (default "
                   "~/.cache/ndtrain/hardware.json), or a GPU's, whose measured constants replace the catalog's")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--global-batch-tokens", help="tokens per step; k/M suffixes are binary (16M = 2048 x 8192)")
    p.add_argument("--global-batch", type=int, help="sequences per step")
    p.add_argument("--tokens", help=f"token budget for days and energy (decimal: 15T = 15e12; default {DEFAULT_TOKENS}, "
                   "said in the output)")
    p.add_argument("--batch-ramp", help="price a ramped run on the first layout: [[tokens_seen, global_batch], ...] as "
                   "train.batch_ramp (JSON); --global-batch is the batch before the first threshold")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--layout", help="evaluate one layout: tp=8,pp=16,dp_shard=64,micro_batch=1,"
                   "activation_checkpoint=full,pp_schedule=... (the layout syntax of verify and config check)")
    p.add_argument("--fix", help="pin layout keys in the search, e.g. tp=8,pp=16")
    p.add_argument("--mb", help="micro-batch sizes to try, e.g. 1,2,4 (default powers of two to 64)")
    p.add_argument("--schedules", help=f"comma list from {', '.join(SCHEDULES)}")
    p.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    p.add_argument("--stack", default="ndtrain", choices=list(STACKS),
                   help="the software the run uses: which kernels it has and which communication it overlaps "
                        "(docs/planner.md, Stacks)")
    p.add_argument("--power-limit", type=float, metavar="WATTS",
                   help="the board power the GPUs are held to (nvidia-smi -pl); below the TDP compute-bound "
                        "kernels run at a lower sustained clock (docs/planner.md, power)")
    p.add_argument("--network", help="the network as built: nvlink=GPUS (NVLink domain), pod=GPUS (full bisection "
                   "below), oversub=R (above the pod), nic=GB/s (per GPU and direction), e.g. pod=3072,oversub=7")
    p.add_argument("--samples", type=int, default=32,
                   help="sampled worlds of the constants' ranges for intervals and robustness (0: off)")
    p.add_argument("--strict", action="store_true",
                   help="only layouts the ndtrain runtime builds (the default; kept for scripts that pass it)")
    p.add_argument("--relaxed", action="store_true",
                   help="also layouts only other runtimes build (Megatron-LM's kv-head replication, GeLU MLPs): "
                        "for comparing with published runs; ndtrain cannot train them")
    p.add_argument("--explain", action="store_true",
                   help="say why the runner-up and other meshes lost, and why near-equals were ranked as they are")
    p.add_argument("--json", action="store_true")
    p.add_argument("--replicas-across", metavar="BW[,LATENCY]", help="the dp_replicate replicas sit on different "
                   "sites joined by BW per site (10Gbit, 1.25GB/s) with LATENCY one way (default 10ms): compare "
                   "per-step sync with DiLoCo (docs/diloco.md)")
    p.add_argument("--diloco", default=None, metavar="H[:F[:OVERLAP]][:bf16],...",
                   help="DiLoCo variants for --replicas-across (default 8,32,128,500,32:4:1)")
    return p


def _fixed(text: str | None) -> dict:
    """`--fix` items in the layout syntax -> {Layout field: value}."""
    if not text:
        return {}
    out = parse_items(text, "--fix")
    if out.get("activation_checkpoint", PLANNED_AC[0]) not in PLANNED_AC:
        raise NdtrainError(f"--fix: activation_checkpoint must be one of {', '.join(PLANNED_AC)}")
    return out


def _network(text: str | None) -> dict | None:
    """`--network` items -> Hardware fields."""
    if not text:
        return None
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in NETWORK_KEYS:
            raise NdtrainError(f"--network: bad item {item!r}; keys are {', '.join(NETWORK_KEYS)}")
        field, scale = NETWORK_KEYS[key]
        try:
            number = float(value)
        except ValueError as exc:
            raise NdtrainError(f"--network: {key}={value!r} is not a number") from exc
        if number <= 0 or (key == "oversub" and number < 1):
            raise NdtrainError(f"--network: {key} must be positive" + (" and at least 1" if key == "oversub" else ""))
        out[field] = type(scale)(number * scale) if isinstance(scale, int) else number * scale
    return out
def _check_plan_args(args) -> None:
    """Every argument, up front, with its flag named."""
    for flag, value in (("--gpus", args.gpus), ("--seq", args.seq), ("--top", args.top)):
        if value < 1:
            raise NdtrainError(f"{flag} must be a positive integer, got {value}")
    if args.global_batch is not None and args.global_batch < 1:
        raise NdtrainError(f"--global-batch must be a positive integer, got {args.global_batch}")
    if args.profile is not None:
        from pathlib import Path

        if not Path(args.profile).expanduser().is_file():
            raise NdtrainError(f"--profile {args.profile}: no such file (`ndtrain calibrate --out {args.profile}` "
                               f"writes one)")
    if args.tokens is not None and _count(args.tokens) <= 0:
        raise NdtrainError(f"--tokens must be a positive token count, got {args.tokens!r}")


def plan_main(argv: list[str]) -> int:
    args = plan_parser().parse_args(argv)
    pool = None
    if str(args.gpus).strip().isdigit():
        args.gpus = int(args.gpus)
    else:
        from ndtrain.planner.hetero import parse_pool

        pool = parse_pool(args.gpus)
        args.gpus = sum(n for _, n in pool)
    _check_plan_args(args)
    cfg = resolve_model(args.model, args.model_shape)
    if args.strict and args.relaxed:
        raise NdtrainError("give --strict or --relaxed, not both")
    if args.global_batch and args.global_batch_tokens:
        raise NdtrainError("give --global-batch or --global-batch-tokens, not both")
    if args.global_batch:
        batch = args.global_batch
    elif args.global_batch_tokens:
        tokens = _count(args.global_batch_tokens, binary=True)
        batch = round(tokens / args.seq)
        if batch < 1 or abs(batch * args.seq - tokens) > 0.01 * tokens:
            raise NdtrainError(f"--global-batch-tokens {args.global_batch_tokens} is not a whole number of "
                               f"{args.seq}-token sequences")
    else:
        raise NdtrainError("give --global-batch SEQUENCES or --global-batch-tokens TOKENS")
    budget = _count(args.tokens or DEFAULT_TOKENS)
    if args.samples < 0:
        raise NdtrainError("--samples must be 0 (off) or a positive number of sampled worlds")
    if pool is not None:
        return _plan_pool(args, cfg, batch, pool)
    pb = make_problem(cfg, args.seq, batch, args.gpus, args.gpu, stack=args.stack, precision=args.precision,
                      strict=not args.relaxed, profile=args.profile, network=_network(args.network),
                      power_w=args.power_limit or 0.0)
    if args.layout:
        lay = dataclasses.replace(parse_layout(parse_items(args.layout, "--layout"), args.gpus),  # errors name the flag
                                  mixed_precision=args.precision)
        ev = Evaluator(pb)
        pred = ev(lay)
        res = SearchResult(top=[pred], considered=1, evaluated=1, fitting=int(pred.fits), seconds=0.0)
    else:
        try:
            mbs = [int(x) for x in args.mb.split(",")] if args.mb else None
        except ValueError as exc:
            raise NdtrainError(f"--mb must be a comma list of integers, got {args.mb!r}") from exc
        if mbs is not None and min(mbs) < 1:
            raise NdtrainError(f"--mb sizes must be positive, got {args.mb!r}")
        scheds = tuple(canonical_schedule(s) for s in args.schedules.split(",")) if args.schedules else None
        # more candidates than shown: the robustness check re-times them in sampled worlds
        res = search(pb, top_k=max(8, args.top), fixed=_fixed(args.fix), mb_options=mbs, schedules=scheds)
    rob = assess(pb, res, worlds=args.samples) if args.samples else None
    shown = (rob.ranked(res.top) if rob else res.top)[:max(1, args.top)]
    across = None
    if args.replicas_across and shown:
        from ndtrain.planner import diloco

        bw, latency = diloco.parse_across(args.replicas_across)
        across = diloco.across_report(pb, shown[0].layout, bw, latency,
                                      diloco.parse_variants(args.diloco or diloco.DEFAULT_VARIANTS))
    ramp = _ramp_price(args, cfg, batch, budget, shown) if args.batch_ramp else None
    if args.json:
        out = {
            **({"batch_ramp": ramp} if ramp else {}),
            "model": cfg.preset, "gpus": args.gpus, "hardware": pb.hw.name, "seq": args.seq, "global_batch": batch,
            "precision": args.precision, "stack": args.stack, "token_budget": budget,
            "token_budget_from": "--tokens" if args.tokens else "default",
            "search": {"considered": res.considered, "sized": res.sized, "evaluated": res.evaluated, "fitting": res.fitting,
                       "seconds": res.seconds},
            "layouts": [{**p.to_json(budget, args.gpus, pb.hw.board_w), "layout_text": p.layout.text(),
                         "config_check": check_command(pb, p.layout), "compile": compile_for_budget(pb, p, budget),
                         **robust_json(rob, p)} for p in shown],
            "fastest_over_cap": res.fastest_over_cap.to_json() if res.fastest_over_cap else None,
            **({"refusal": refusal_lines(pb, res)} if not res.top else {}),
            "robustness": {"worlds": rob.worlds, "share_within_2pct": rob.share, "reason": rob.reason,
                           "constants": pb.k} if rob else None,
            **({"replicas_across": across} if across else {}),
        }
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print(plan_text(pb, res, budget, args.explain, rob=rob, shown=shown)
              + (diloco.across_text(across) if across else ""))
        if ramp:
            print(ramp["line"])
        if args.tokens is None:
            print(f"days and energy are for a budget of {DEFAULT_TOKENS} tokens (the default): give yours with --tokens")
    return 0 if res.top else 1


def _ramp_price(args, cfg, batch: int, budget: float, shown: list) -> dict | None:
    """The first layout's price for the run with its batch ramp: each batch's predicted step time
    over the tokens it trains (planner/batch_ramp.py)."""
    from ndtrain.planner.batch_ramp import parse_ramp, price

    ramp = parse_ramp(args.batch_ramp)
    if not shown:
        return None
    lay = shown[0].layout

    def step_seconds(b: int) -> float:
        pb = make_problem(cfg, args.seq, b, args.gpus, args.gpu, stack=args.stack, precision=args.precision,
                          strict=not args.relaxed, profile=args.profile, network=_network(args.network),
                          power_w=args.power_limit or 0.0)
        return Evaluator(pb)(lay).step_time

    out = price(budget, batch, ramp, args.seq, step_seconds)
    fixed = budget / shown[0].tokens_per_s
    out["line"] = (f"with batch_ramp {ramp}: {out['days']:,.1f} days at a time-weighted {out['tokens_per_s']:,.0f} "
                   f"tokens/s over {out['steps']:,.0f} steps (at global batch {batch} throughout: "
                   f"{fixed / 86400:,.1f} days)")
    return out


def _plan_pool(args, cfg, batch: int, pool: list) -> int:
    """`--gpus 64xh100,64xa100`: the mixed pool's best layouts, the uniform split, the best subset."""
    from ndtrain.planner.hetero import plan_pool, pool_text

    for flag in ("layout", "profile", "replicas_across"):
        if getattr(args, flag):
            raise NdtrainError(f"--{flag.replace('_', '-')} is not planned for a mixed pool yet; give one GPU kind")

    def make(kind, world, global_batch):
        return make_problem(cfg, args.seq, global_batch or batch, world, kind, stack=args.stack,
                            precision=args.precision, strict=not args.relaxed, network=_network(args.network),
                            power_w=args.power_limit or 0.0)

    result = plan_pool(pool, make, top=args.top)
    if args.json:
        def js(p):
            return p.to_json() if p else None

        json.dump({"model": cfg.preset, "gpus": args.gpus, "pool": [{"kind": k, "count": n} for k, n in pool],
                   "seq": args.seq, "global_batch": batch, "precision": args.precision,
                   "layouts": [p.to_json() for p in result["layouts"]],
                   "baselines": {"uniform": js(result["uniform"]), "best_subset": js(result["best_subset"])},
                   "candidates": result["candidates"]}, sys.stdout, indent=1)
        print()
    else:
        print(pool_text(result, pool))
    return 0 if result["layouts"] else 1


# The phases of an exclusion (tools/run_data.membership_phases, docs/self-healing.md): detection
# trains on at the slow pace; the others stop training.
PHASES = [("detect", "time from the first slow window to the decision (trained on, at the slow pace)"),
          ("save", "the exclusion's checkpoint save"), ("rendezvous", "re-rendezvous, to the new workers' imports done"),
          ("reshard", "process group, re-plan and checkpoint load onto the new layout"),
          ("warmup", "the new world's first steps beyond its steady step time")]


def goodput_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ndtrain goodput", description="Expected training goodput under failures and the "
                "optimal checkpoint interval (Young, Daly), checked by Monte-Carlo simulation.")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--mtbf-gpu-hours", type=float, required=True,
                   help="mean time between failures of one GPU (with its share of host and network), hours")
    p.add_argument("--ckpt-save", required=True, help="time a checkpoint blocks training: 90s, 2m, ...")
    p.add_argument("--restart", required=True, help="time from failure to training again: 10m, ...")
    p.add_argument("--days", type=float, default=30.0, help="days of useful training per simulated run")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--straggler", type=float, help="also price excluding a host this much slower (0.3: 30%%) "
                   "against keeping it (docs/self-healing.md); needs --hosts and --exclude-cost")
    p.add_argument("--hosts", type=int, help="hosts (torchrun agents) in the job, for --straggler")
    p.add_argument("--exclude-cost", help="time an exclusion stops training, as `ndtrain report` measures it: 40s, ... "
                   "(or its phases, below)")
    for phase, what in PHASES:
        p.add_argument(f"--exclude-{phase}", metavar="DURATION",
                       help=f"{what}, as `ndtrain report` measures it (for --straggler)")
    p.add_argument("--exclusion-costs", metavar="RUN_DIR", help="take the phases an exclusion cost from this run "
                   "directory's membership changes (the median of its exclusions); flags given win")
    p.add_argument("--json", action="store_true")
    return p


def goodput_main(argv: list[str], measured=None) -> int:
    """`measured(run_dir)`: the phases (seconds by PHASES name) of the exclusions a run directory
    recorded, for --exclusion-costs (tools/goodput_costs.py reads them; the planner reads no run)."""
    args = goodput_parser().parse_args(argv)
    try:
        ckpt, restart = parse_duration(args.ckpt_save), parse_duration(args.restart)
    except ValueError as exc:
        raise NdtrainError(str(exc)) from exc
    checks = [("--gpus", 1 <= args.gpus <= 10**8, "an integer from 1 to 10^8", args.gpus),
              ("--mtbf-gpu-hours", math.isfinite(args.mtbf_gpu_hours) and args.mtbf_gpu_hours > 0,
               "a finite number of hours > 0", args.mtbf_gpu_hours),
              ("--ckpt-save", 0 < ckpt < 1e9, "a duration > 0", args.ckpt_save),
              ("--restart", 0 <= restart < 1e9, "a duration >= 0", args.restart),
              # the simulation walks every segment of every trial: its size must be bounded
              ("--days", math.isfinite(args.days) and 0 < args.days <= 36500, "a number of days in (0, 36500]",
               args.days),
              ("--trials", 1 <= args.trials <= 100_000, "an integer from 1 to 100000", args.trials)]
    excl, detect = None, 0.0
    phases = {name: getattr(args, f"exclude_{name}") for name, _ in PHASES}
    if args.exclusion_costs is not None:
        if measured is None:
            raise NdtrainError("--exclusion-costs needs the run reader of `ndtrain goodput` (tools), not the planner alone")
        phases = {**measured(args.exclusion_costs), **{k: v for k, v in phases.items() if v is not None}}
    given = [f"--exclude-{k}" for k, v in phases.items() if v is not None]
    if args.straggler is not None or args.hosts is not None or args.exclude_cost is not None or given:
        if args.exclude_cost is not None and given and args.exclusion_costs is None:
            raise NdtrainError(f"--exclude-cost is the sum of the phases: give it or {', '.join(given)}, not both")
        if args.straggler is None or args.hosts is None or (args.exclude_cost is None and not given):
            raise NdtrainError("--straggler, --hosts and --exclude-cost (or its phases, --exclude-save ...) go together "
                               "(pricing an exclusion needs all three)")
        try:
            seconds = {k: parse_duration(v) for k, v in phases.items() if v is not None}
            excl = parse_duration(args.exclude_cost) if args.exclude_cost is not None else \
                sum(v for k, v in seconds.items() if k != "detect")
        except ValueError as exc:
            raise NdtrainError(str(exc)) from exc
        detect = seconds.get("detect", 0.0)
        checks += [("--straggler", math.isfinite(args.straggler) and 0 < args.straggler <= 100, "a fraction in (0, 100]",
                    args.straggler),
                   ("--hosts", 2 <= args.hosts <= 10**6, "an integer from 2 to 10^6", args.hosts),
                   ("--exclude-cost", 0 <= excl < 1e9, "a duration >= 0", args.exclude_cost)]
        checks += [(f"--exclude-{k}", 0 <= v < 1e9, "a duration >= 0", phases[k]) for k, v in seconds.items()]
    for flag, ok, what, value in checks:
        if not ok:
            raise NdtrainError(f"{flag} must be {what}, got {value!r}")
    rep = goodput_report(args.gpus, args.mtbf_gpu_hours, ckpt, restart, args.days, args.trials, args.seed)
    if excl is not None:
        rep["exclusion"] = exclusion(args.straggler, args.hosts, excl, detect)
        rep["exclusion_job"] = price_exclusion(rep["exclusion"], args.gpus, args.mtbf_gpu_hours, ckpt, restart,
                                               args.days, args.trials, args.seed)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        print()
    else:
        print(goodput_text(rep))
    return 0
