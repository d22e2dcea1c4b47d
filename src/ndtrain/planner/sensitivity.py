"""How far each constant can move before a plan changes.

For each constant the nominal value is scaled step by step down (x0.98 ... x0.5) and up
(x1.02 ... x2) and the whole search is rerun at each step (no shortcut: the answer is what the
planner would say). Two moments are reported per direction:
  * the first step at which the fastest layout is another one ("changes"), with that layout;
  * the first step at which the nominal plan is more than 2% slower than the new fastest, or no
    longer fits ("matters"): before it, the plan may have changed, but only between near-equals.
A plan that survives moves larger than the constant's own range does not hinge on that constant.
Constants the search never reads for this problem (fp8 constants in a bf16 run, MoE constants for
a dense model, fused-kernel traffic under an eager stack) are listed as not used: it is recorded
which constants the nominal search reads, so this is exact, not a guess.

    python -m ndtrain.planner.sensitivity        # the 16,384-GPU Llama 3 405B plan (docs/results/)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from ndtrain.model.config import preset
from ndtrain.planner import constants as consts
from ndtrain.planner.problem import Problem, make_problem
from ndtrain.planner.search import Evaluator, search

DOWN = (0.98, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
UP = (1.02, 1.05, 1.1, 1.25, 1.5, 2.0)
MATTERS = 0.02  # the nominal plan more than 2% slower than the fastest


class _Reads(dict):
    """The constants dict, recording which names are read."""

    def __init__(self, values):
        super().__init__(values)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


def constants_read(pb: Problem) -> set:
    """The constants a search of `pb` reads (the others cannot change its answer)."""
    rec = _Reads(pb.k)
    search(dataclasses.replace(pb, k=rec), top_k=1)
    return rec.read


def regret(moved: Problem, base_layout, best) -> float:
    """How much slower `base_layout` is than `best` in the moved world (inf: it no longer fits)."""
    p = Evaluator(moved)(base_layout, check=False)
    return p.step_time / best.step_time - 1 if p.fits else float("inf")


def scan(pb: Problem, name: str, factors, base_layout) -> dict:
    """Walk `factors`: the first at which the fastest layout changes (and to what), and the first at
    which that matters (the nominal plan >2% slower than the fastest, or not fitting)."""
    out = {"change": None, "to": "", "matters": None, "loss": 0.0}
    for f in factors:
        moved = pb.with_constants({name: pb.k[name] * f})
        top = search(moved, top_k=1).top
        if not top:
            out["change"] = out["change"] or f
            out["matters"], out["loss"] = f, float("inf")
            break
        if top[0].layout != base_layout:
            if out["change"] is None:
                out["change"], out["to"] = f, top[0].layout.short()
            loss = regret(moved, base_layout, top[0])
            if loss > MATTERS:
                out["matters"], out["loss"] = f, loss
                break
    return out


def first_change(pb: Problem, name: str, factors, base_layout) -> tuple[float | None, str]:
    """(the first factor at which the top layout is not `base_layout`, that layout), or (None, "")."""
    r = scan(pb, name, factors, base_layout)
    return r["change"], r["to"]


def sensitivity(pb: Problem, names=None) -> list[dict]:
    base = search(pb, top_k=1).top[0].layout
    bounds = consts.ranges(pb.hw.generation)
    used = constants_read(pb)
    rows = []
    for name in names or [*consts.TIME_CONSTANTS, *consts.MEMORY_CONSTANTS]:
        if name not in pb.k:
            continue
        nominal = pb.k[name]
        lo, hi = bounds.get(name, (nominal, nominal))
        row = {"constant": name, "nominal": nominal, "used": name in used and nominal != 0,
               "range": (lo / nominal, hi / nominal) if nominal else (1.0, 1.0)}
        if row["used"]:
            row["down"], row["up"] = scan(pb, name, DOWN, base), scan(pb, name, UP, base)
        rows.append(row)
    return rows


def _side(s: dict, limit: str) -> tuple[str, str]:
    change = f"x{s['change']:g} -> {s['to']}" if s["change"] else f"none to {limit}"
    if s["matters"] is None:
        return change, f"none to {limit}"
    loss = "no longer fits" if s["loss"] == float("inf") else f"{s['loss']:+.1%}"
    return change, f"x{s['matters']:g} ({loss})"


def sensitivity_markdown(rows: list[dict], base: str) -> str:
    lines = [f"plan at nominal constants: {base}", "",
             "| constant | nominal | range (x nominal) | fastest changes, down | fastest changes, up | "
             "plan >2% off, down | plan >2% off, up | change within range? | >2% within range? |",
             "|---|---|---|---|---|---|---|---|---|"]
    unused = []
    for r in rows:
        if not r["used"]:
            unused.append(r["constant"])
            continue
        lo, hi = r["range"]
        dc, dm = _side(r["down"], "x0.5")
        uc, um = _side(r["up"], "x2")

        def inside(key):
            d, u = r["down"][key], r["up"][key]
            return "yes" if (d is not None and d >= lo) or (u is not None and u <= hi) else "no"

        lines.append(f"| {r['constant']} | {r['nominal']:.3g} | {lo:.2f}-{hi:.2f} | {dc} | {uc} | {dm} | {um} | "
                     f"{inside('change')} | {inside('matters')} |")
    if unused:
        lines.append(f"\nnot read by this problem's search (cannot change it): {', '.join(unused)}")
    return "\n".join(lines)


def llama3_405b_problem() -> Problem:
    """The example of docs/results/planner-validation.md: Llama 3 405B, 16,384 H100, 16M-token
    batches of 8K, Meta's network."""
    return make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100",
                        network={"pod_gpus": 3072, "oversubscription": 7.0})


def main(argv: list[str] | None = None) -> int:
    pb = llama3_405b_problem()
    start, cpu = time.perf_counter(), time.process_time()
    base = search(pb, top_k=1).top[0].layout.short()
    rows = sensitivity(pb)
    print(sensitivity_markdown(rows, base))
    print(f"\n({time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu:.0f} s CPU; "
          f"load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
