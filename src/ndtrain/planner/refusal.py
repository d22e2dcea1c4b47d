"""Why a search found no layout: the rule or refusal that emptied it, and the flag that lifts it.

The search (planner/search.py) records what it dropped: meshes that could not be formed, layouts
that `ndtrain.layout.problems()` refused (by config key, with the first message and layout), and
the smallest model states that exceeded the GPU before any activation. An empty search is
explained from the first of these that took everything, so "no layout fits in memory" is said
only when memory is what emptied it.
"""

from __future__ import annotations

from ndtrain.layout import Layout
from ndtrain.model.config import num_params
from ndtrain.planner.accelerator import GiB
from ndtrain.planner.problem import Problem

# What lifts a refusal on each config key (the `--fix` / flag a user changes).
KEY_HINTS = {
    "model.mlp": "the model's MLP",
    "parallel.tp": "tp= (a degree that divides the heads, kv heads, FFN and vocabulary)",
    "parallel.pp": "pp= (at most one stage per layer)",
    "parallel.ep": "ep= (a divisor of the experts and of dp_shard*cp)",
    "parallel.zero": "zero=",
    "train.global_batch": "--global-batch (or dp_replicate= / dp_shard= so that it divides)",
    "train.micro_batch": "--mb or the pipeline's micro-batches",
    "data.seq_len": "--seq or cp=",
}


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _rules_line(pb: Problem, rules: dict) -> list[str]:
    key, (count, message, lay) = max(rules.items(), key=lambda item: item[1][0])
    out = [f"no layout is valid: {count:,} layout{'s' if count > 1 else ''} refused by the rule on {key}: {message}"]
    if pb.lifted_by_relaxed(lay):
        out.append("  only the ndtrain runtime refuses it: `--relaxed` also admits layouts other runtimes build "
                   "(to compare with published runs; ndtrain cannot train them)")
    elif key in KEY_HINTS:
        out.append(f"  change {KEY_HINTS[key]} (--fix pins it, --layout gives one layout)")
    others = sorted((k for k in rules if k != key), key=lambda k: -rules[k][0])
    if others:
        out.append("  other refusals: " + "; ".join(f"{k} ({rules[k][0]:,}): {rules[k][1]}" for k in others[:3]))
    return out


def _states_line(pb: Problem, need: float, lay: Layout, fixed: dict) -> list[str]:
    cap = pb.hw.hbm_bytes
    if lay.shard_degree == 1 and "zero" in fixed and lay.dp_replicate > 1:
        return [f"no layout fits: zero={fixed['zero']} shards model states over dp_shard x cp, which is 1 here "
                f"(dp_replicate={lay.dp_replicate} holds whole replicas), so model states alone need at least "
                f"{_gib(need)} per GPU and the GPU has {_gib(cap)}",
                f"  shard them with dp_shard= (e.g. --fix dp_shard={lay.dp_replicate},zero={fixed['zero']}, or "
                f"HSDP: dp_replicate=R,dp_shard={lay.dp_replicate}/R)"]
    pinned = ", ".join(f"{k}={v}" for k, v in fixed.items())
    return [f"no layout fits: model states alone need at least {_gib(need)} per GPU in every mesh searched "
            f"(least: {lay.short()}), before activations, and the GPU has {_gib(cap)}"
            + (f"; pinned: {pinned}" if pinned else ""),
            "  more GPUs, zero=3, or tp=/pp= to split the model lift it" + (" (or unpin --fix)" if pinned else "")]


def refusal_lines(pb: Problem, res) -> list[str]:
    """The cause of an empty search `res` (a SearchResult with no top layout), in a few lines."""
    r = res.refusals or {}
    fixed = r.get("fixed", {})
    if r and not r.get("meshes"):
        pinned = ", ".join(f"{k}={v}" for k, v in fixed.items() if k in ("tp", "cp", "pp", "dp_shard", "dp_replicate"))
        return [f"no mesh of {pb.world:,} GPUs can be formed" + (f" with {pinned}" if pinned else "") +
                f": tp must divide the heads ({pb.shape.heads}) and kv heads ({pb.shape.kv_heads}) and fit a node "
                f"({pb.hw.gpus_per_node}), cp keep s/cp >= 256, pp <= layers ({pb.shape.layers}), and the data-"
                f"parallel size divide the global batch ({pb.global_batch})",
                "  change the pinned degrees (--fix), --gpus or --global-batch"]
    if res.sized == 0 and (r.get("rules") or r.get("states")):
        lines = _rules_line(pb, r["rules"]) if r.get("rules") else []
        if r.get("states"):
            lines += _states_line(pb, *r["states"], fixed)
        return lines
    floor = 16 * num_params(pb.cfg) / pb.world
    return [f"no layout fits in memory: model states alone need {_gib(floor)} per GPU even when fully sharded, "
            f"activations come on top, and the GPU has {_gib(pb.hw.hbm_bytes)}"]
