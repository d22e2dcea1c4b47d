"""How far each constant can move before a plan changes.

For each constant, the nominal value is scaled step by step down (x0.98 ... x0.5) and up
(x1.02 ... x2) and the whole search is rerun at each step (no shortcut: the answer is what the
planner would say); the first step at which the fastest layout differs is reported, with the
layout it changes to. A plan that survives moves larger than the constant's own range does not
hinge on that constant.

    python -m ndtrain.planner.sensitivity        # the 16,384-GPU Llama 3 405B plan of docs/planner.md
"""

from __future__ import annotations

import sys
import time

from ndtrain.model.config import preset
from ndtrain.planner import constants as consts
from ndtrain.planner.problem import Problem, make_problem
from ndtrain.planner.search import search

DOWN = (0.98, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
UP = (1.02, 1.05, 1.1, 1.25, 1.5, 2.0)


def first_change(pb: Problem, name: str, factors, base_layout) -> tuple[float | None, str]:
    """(the first factor at which the top layout is not `base_layout`, that layout), or (None, "")."""
    for f in factors:
        moved = pb.with_constants({name: pb.k[name] * f})
        top = search(moved, top_k=1).top
        if top and top[0].layout != base_layout:
            return f, top[0].layout.short()
    return None, ""


def sensitivity(pb: Problem, names=None) -> list[dict]:
    base = search(pb, top_k=1).top[0].layout
    bounds = consts.ranges(pb.hw.generation)
    rows = []
    for name in names or [*consts.TIME_CONSTANTS, *consts.MEMORY_CONSTANTS]:
        if not pb.k.get(name):
            continue
        lo, hi = bounds.get(name, (pb.k[name], pb.k[name]))
        down, to_down = first_change(pb, name, DOWN, base)
        up, to_up = first_change(pb, name, UP, base)
        rows.append({"constant": name, "nominal": pb.k[name], "range": (lo / pb.k[name], hi / pb.k[name]),
                     "down": down, "down_to": to_down, "up": up, "up_to": to_up})
    return rows


def markdown(rows: list[dict], base: str) -> str:
    lines = [f"plan at nominal constants: {base}", "",
             "| constant | nominal | its range (x nominal) | first change down | first change up | within its range? |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["range"]
        down = f"x{r['down']:g} -> {r['down_to']}" if r["down"] else "none down to x0.5"
        up = f"x{r['up']:g} -> {r['up_to']}" if r["up"] else "none up to x2"
        inside = (r["down"] is not None and r["down"] >= lo) or (r["up"] is not None and r["up"] <= hi)
        lines.append(f"| {r['constant']} | {r['nominal']:.3g} | {lo:.2f}-{hi:.2f} | {down} | {up} | "
                     f"{'yes' if inside else 'no'} |")
    return "\n".join(lines)


def llama3_405b_problem() -> Problem:
    """The docs/planner.md example: Llama 3 405B, 16,384 H100, 16M-token batches of 8K, Meta's network."""
    return make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100",
                        network={"pod_gpus": 3072, "oversubscription": 7.0})


def main(argv: list[str] | None = None) -> int:
    pb = llama3_405b_problem()
    start = time.perf_counter()
    base = search(pb, top_k=1).top[0].layout.short()
    rows = sensitivity(pb)
    print(markdown(rows, base))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
