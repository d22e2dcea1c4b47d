"""Layout parity: train N steps in each layout from the same initial weights and data, and compare
losses, grad norms and updated weights with a single process.

Used by `ndtrain verify` and by the parity tests. Layouts of one world size share one launch of
ranks (a process group costs seconds to start); each layout builds its own mesh inside it.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch

from ndtrain.config import JobConfig, TrainConfig, load_config, parse_value
from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout, parse_items, parse_layout
from ndtrain.layout import schedules as registry
from ndtrain.parallel.dims import checked_layout


def layout_overrides(spec: str) -> dict:
    """A layout in the one layout syntax, `key=value` items joined by commas, -> config overrides.
    Keys are ndtrain.layout's (the layout keys, or their older short forms: layout/syntax.py's
    KEY_ALIASES), plus `ga=K` (micro_batch = global/(dp*K)) and any `section.key`.
    Degrees not given are 1, except that ep=N alone takes N data-parallel ranks (dp_shard = N/cp),
    as a user asking for expert parallel expects."""
    if not spec.strip() or any(ch.isspace() for ch in spec.strip()):
        raise NdtrainError(f"layout {spec!r}: items are key=value joined by commas, one layout per argument "
                           f"(e.g. dp_shard=2,tp=2)")
    items, extra, ga = {}, {}, None
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, text = item.partition("=")
        if not sep:
            raise NdtrainError(f"layout item {item!r} is not key=value (in {spec!r})")
        if key == "ga":
            ga = parse_value(text)
        elif "." in key:
            section, k = key.split(".", 1)
            extra.setdefault(section, {})[k] = parse_value(text)
        else:
            items[key] = text
    fields = parse_items(items, f"layout {spec!r}")
    if "dp_shard" not in fields:
        ep, cp = fields.get("ep", 1), fields.get("cp", 1)
        fields["dp_shard"] = ep // math.gcd(ep, cp) if ep > 1 else 1
    lay = parse_layout(fields, base=Layout())
    out: dict = {"parallel": {}, **lay.config_overrides(set(fields) | {"dp_shard", "reshard_after_forward",
                                                                        "pp_virtual_stages"})}
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    if ga is not None:
        out["_ga"] = ga
    return out


def layout_world(overrides: dict) -> int:
    p = overrides["parallel"]
    w = 1
    for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        w *= int(p.get(k, 1))
    return w


def layout_config(base: dict, spec: str) -> JobConfig:
    ov = layout_overrides(spec)
    ga = ov.pop("_ga", None)
    merged = {k: dict(v) for k, v in base.items()}
    for section, values in ov.items():
        merged.setdefault(section, {}).update(values)
    par = ov["parallel"]
    pp = int(par.get("pp", 1))
    if ga is None:
        # A pipeline layout without ga= runs the fewest micro-batches its schedule accepts (at
        # least pp, so that GPipe pipelines too).
        ga = max(pp, registry.get(par.get("pp_schedule", registry.DEFAULT)).min_microbatches(pp)) if pp > 1 else 1
    world = layout_world(ov)
    dp = world // (int(par.get("tp", 1)) * pp * int(par.get("cp", 1)))
    if "micro_batch" not in ov.get("train", {}):
        gb = merged.get("train", {}).get("global_batch", TrainConfig().global_batch)
        merged.setdefault("train", {})["micro_batch"] = max(1, gb // (dp * ga))
    cfg = load_config(None, merged)
    # The one validity check, for this layout's world, before any rank starts.
    checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, cfg.train)
    return cfg


def run_steps(cfg: JobConfig, steps: int) -> dict:
    """Train `steps` steps in this process group; return losses, grad norms and full weights."""
    from ndtrain.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir=None, log=False)
    losses, norms = [], []
    for _ in range(steps):
        r = trainer.train_step()
        losses.append(r.loss)
        norms.append(r.grad_norm)
    weights = trainer.full_weights()
    trainer.close()
    if cfg.parallel.compile:
        # The next layout in this process compiles afresh: with TP, a graph cached for one layout's
        # local shapes was reused for the next one's ("shape '[64, 32]' is invalid", torch 2.13).
        torch.compiler.reset()
    return {"losses": torch.tensor(losses, dtype=torch.float64), "grad_norms": torch.tensor(norms, dtype=torch.float64),
            "weights": weights}


def _run_many(cfgs: list[JobConfig], steps: int) -> list[dict]:
    return [run_steps(cfg, steps) for cfg in cfgs]


def _merge_ranks(per_rank: list[dict]) -> dict:
    """Losses are identical on all ranks; weights of pipeline stages live on different ranks.
    Every rank's copy is kept so a replica that drifted from its peers is caught too."""
    merged = dict(per_rank[0])
    merged["rank_weights"] = [r["weights"] for r in per_rank]
    return merged


@dataclass
class Comparison:
    layout: str
    world: int
    d_loss: float
    d_weight: float
    d_grad_norm: float
    passed: bool


def max_differences(ref: dict, got: dict) -> tuple[float, float, float]:
    d_loss = float((ref["losses"] - got["losses"]).abs().max())
    d_norm = float(((ref["grad_norms"] - got["grad_norms"]).abs() / ref["grad_norms"].abs().clamp_min(1e-12)).max())
    rank_weights = got.get("rank_weights", [got["weights"]])
    names = set().union(*rank_weights)
    if names != set(ref["weights"]):
        raise AssertionError(f"parameter names differ between layouts: {sorted(names ^ set(ref['weights']))[:5]}")
    d_weight = max(float((ref["weights"][k] - w[k].to(ref["weights"][k].dtype)).abs().max())
                   for w in rank_weights for k in w)
    return d_loss, d_weight, d_norm


def verify(base: dict, layouts: list[str], steps: int, tol_loss: float, tol_weight: float,
           timeout_s: float = 300.0) -> tuple[dict, list[Comparison]]:
    from ndtrain.parallel.launch import run_ranks

    ref_cfg = load_config(None, base)
    ref = run_steps(ref_cfg, steps)
    by_world: dict[int, list[str]] = {}
    for spec in layouts:
        by_world.setdefault(layout_world(layout_overrides(spec)), []).append(spec)
    results = []
    for world, specs in by_world.items():
        cfgs = [layout_config(base, s) for s in specs]
        # A compiled world-1 layout runs in a forked rank too: compiling here would start
        # inductor's compile-worker pool in this process, and ranks forked from it afterwards wait
        # on that pool forever (a cold cache hung the compile parity test).
        if world == 1 and not any(c.parallel.compile for c in cfgs):
            outs = [run_steps(c, steps) for c in cfgs]
        else:
            per_rank = run_ranks(world, _run_many, cfgs, steps, timeout_s=timeout_s)
            outs = [_merge_ranks([r[i] for r in per_rank]) for i in range(len(specs))]
        for spec, out in zip(specs, outs):
            d_loss, d_weight, d_norm = max_differences(ref, out)
            results.append(Comparison(spec, world, d_loss, d_weight, d_norm,
                                      # AdamW is nearly scale-invariant, so a gradient-scale bug hides
                                      # in the weights; the grad norm (relative) exposes it.
                                      d_loss <= tol_loss and d_weight <= tol_weight and d_norm <= tol_loss))
    return ref, results


def format_table(results: list[Comparison], tol_loss: float, tol_weight: float) -> str:
    rows = [("layout", "world", "max|Δloss|", "max|Δweight|", "grad-norm rel", "result")]
    for r in results:
        rows.append((r.layout, str(r.world), f"{r.d_loss:.2e}", f"{r.d_weight:.2e}", f"{r.d_grad_norm:.1e}",
                     "PASS" if r.passed else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"tolerance: |Δloss| <= {tol_loss:g}, |Δweight| <= {tol_weight:g}, "
                 f"grad-norm relative error <= {tol_loss:g} (vs world 1)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=[], metavar="LAYOUT",
                   help="one layout per argument, items key=value joined by commas: dp_shard=4 tp=2,dp_shard=2")
    p.add_argument("--config", help="TOML config for model and training (default: debug preset)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tol-loss", type=float, default=None, help="default 1e-5 (fp32) or 2e-2 (bf16, fp8)")
    p.add_argument("--tol-weight", type=float, default=None, help="default 1e-5 (fp32) or 2e-2 (bf16, fp8)")
    args, rest = p.parse_known_args(argv)
    layouts = [s.strip() for s in args.layouts if s.strip()]
    if not layouts:
        raise NdtrainError("give at least one layout: --layouts dp_shard=2 tp=2,dp_shard=2 (one per argument)")
    if args.steps < 1:
        raise NdtrainError(f"--steps must be >= 1, got {args.steps}")
    for flag, tol in (("--tol-loss", args.tol_loss), ("--tol-weight", args.tol_weight)):
        if tol is not None and not (math.isfinite(tol) and tol > 0):  # nan would pass every comparison
            raise NdtrainError(f"{flag} must be a finite number > 0, got {tol}")
    base_cfg = load_config(args.config, rest)
    from ndtrain.config import to_dict

    base = to_dict(base_cfg)
    base.pop("name")
    base["parallel"] = {}  # the reference is one process; layouts set their own degrees
    base["train"]["micro_batch"] = base_cfg.train.global_batch
    for spec in layouts:  # every layout checked (problems()) before any rank starts
        layout_config(base, spec)
    low = any("bf16" in s or "fp8" in s for s in layouts)  # fp8 is bf16 outside its fp8 GEMMs
    tol_l = args.tol_loss if args.tol_loss is not None else (2e-2 if low else 1e-5)
    tol_w = args.tol_weight if args.tol_weight is not None else (2e-2 if low else 1e-5)
    _, results = verify(base, layouts, args.steps, tol_l, tol_w)
    print(format_table(results, tol_l, tol_w))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
