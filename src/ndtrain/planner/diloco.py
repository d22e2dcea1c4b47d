"""Replicas on different sites: per-step gradient sync vs DiLoCo (`ndtrain plan --replicas-across`).

The layout's dp_replicate replicas sit on R sites joined by a slower network: `bw` bytes/s per
site and direction, `latency` seconds one way. Everything else of a replica runs inside its site
and costs what the planner predicts for one replica alone (world/R devices, global batch/R).

  per-step sync  every step all-reduces the whole gradient across the sites (all ranks of a site
                 share its uplink, so the full gradient crosses it): ring/tree alpha-beta over
                 R sites; it hides behind the backward (2/3 of the compute) where the stack
                 overlaps gradient reduction. Plus the preemption check of train/recovery.py:
                 one blocking scalar all-reduce across sites per step (one round trip).
  DiLoCo H       an outer all-reduce of the parameters (fp32 or bf16) every H steps, blocking;
                 per step the preemption check too, and the skip flag, which travels while the
                 optimizer steps.
  streaming      F fragments, one every H/F steps, each all-reduce hidden behind `diloco_overlap_steps`
                 steps where it fits.

DiLoCo "pays" below the bandwidth where it is at least PAYS_MARGIN faster per step than per-step
sync: it needs some more tokens for the same loss (docs/results/benchmarks.md measures how many).
"""

from __future__ import annotations

import dataclasses
import math
import re

from ndtrain.errors import NdtrainError
from ndtrain.layout import problems
from ndtrain.planner.comm import _flat
from ndtrain.planner.problem import Problem, make_problem
from ndtrain.planner.search import Evaluator, Prediction
from ndtrain.planner.timing import dp_overlaps

PAYS_MARGIN = 0.10
DEFAULT_VARIANTS = "8,32,128,500,32:4:1"
_BW_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


@dataclasses.dataclass(frozen=True)
class Variant:
    inner_steps: int  # H
    fragments: int = 1
    overlap: int = 0
    outer_bytes: int = 4  # fp32 outer gradient; 2 for bf16

    def layout(self, lay):
        """`lay` with replicate_sync = diloco and this variant's settings (what the trainer would run)."""
        return dataclasses.replace(lay, replicate_sync="diloco", diloco_inner_steps=self.inner_steps,
                                   diloco_fragments=self.fragments, diloco_overlap_steps=self.overlap,
                                   diloco_outer_dtype="bf16" if self.outer_bytes == 2 else "fp32")

    def name(self) -> str:
        if self.fragments == 1 and self.overlap == 0:
            return f"DiLoCo H={self.inner_steps}"
        return f"streaming H={self.inner_steps} F={self.fragments} overlap={self.overlap}"


def parse_bandwidth(text: str) -> float:
    """Bytes/s from `10Gbit`, `10Gbps`, `100 Mbit/s`, `1.25GB/s` (B = bytes, bit/b = bits)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)\s*(bit|bps|b|B)?(?:/s)?\s*", text)
    if not m:
        raise NdtrainError(f"--replicas-across: {text!r} is not a bandwidth (e.g. 10Gbit, 1.25GB/s)")
    value = float(m.group(1)) * _BW_UNITS[m.group(2).lower()]
    return value if m.group(3) == "B" else value / 8


def parse_latency(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", text)
    if not m:
        raise NdtrainError(f"--replicas-across: {text!r} is not a latency (e.g. 20ms)")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2)]


def parse_across(text: str) -> tuple[float, float]:
    """`BW[,LATENCY]` -> (bytes/s, seconds); latency defaults to 10 ms (one way)."""
    bw, _, lat = text.partition(",")
    out = parse_bandwidth(bw), parse_latency(lat) if lat else 0.01
    if out[0] <= 0:
        raise NdtrainError("--replicas-across: the bandwidth must be positive")
    return out


def parse_variants(text: str) -> list[Variant]:
    """`8,32,32:4:1,64:2:1:bf16` -> DiLoCo H=8, H=32, streaming H=32 F=4 overlap 1, ... ."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        try:
            dtype = parts.pop() if parts[-1] in ("fp32", "bf16") else "fp32"
            nums = [int(p) for p in parts] + [1, 0][len(parts) - 1:]
            h, f, o = nums[:3]
        except (ValueError, IndexError):
            raise NdtrainError(f"--diloco: {item!r} is not H[:FRAGMENTS[:OVERLAP]][:bf16]") from None
        out.append(Variant(h, f, o, 2 if dtype == "bf16" else 4))  # checked by the layout rule in across_report
    if not out:
        raise NdtrainError("--diloco: give at least one H")
    return out


def replica_prediction(pb: Problem, lay, profile=None) -> Prediction:
    """One replica alone: world/R devices, global batch/R, the layout without its replicas."""
    r = lay.dp_replicate
    sub = make_problem(pb.cfg, pb.seq, pb.global_batch // r, pb.world // r, pb.hw, stack=pb.stack,
                       precision=pb.precision, strict=pb.strict)
    return Evaluator(sub)(dataclasses.replace(lay, dp_replicate=1), check=False)


def step_times(pb: Problem, inner: Prediction, replicas: int, bw: float, latency: float,
               variants: list[Variant]) -> list[dict]:
    """Seconds per step for per-step sync and each DiLoCo variant at (bw, latency)."""
    params = pb.shape.total_params
    grad_bytes = 4 if pb.precision == "fp32" else pb.stack.grad_reduce_bytes
    t_inner = inner.step_time
    hidden = 2 / 3 * inner.time["compute"] if dp_overlaps(pb) else 0.0
    ar = _flat("all_reduce", replicas, grad_bytes * params, latency, bw)
    scalar = _flat("all_reduce", replicas, 4, latency, bw)  # the preemption check, in either mode
    rows = [{"name": "per-step sync", "step_s": t_inner + max(0.0, ar - hidden) + scalar, "inner_s": t_inner,
             "across_s": max(0.0, ar - hidden), "control_s": scalar, "bytes_per_step": grad_bytes * params}]
    control = scalar + max(0.0, scalar - inner.time["optimizer"])  # + DiLoCo's skip flag, under the optimizer
    for v in variants:
        frag = _flat("all_reduce", replicas, v.outer_bytes * params / v.fragments, latency, bw)
        exposed = max(0.0, frag - v.overlap * t_inner) if v.overlap else frag
        across = v.fragments * exposed / v.inner_steps
        rows.append({"name": v.name(), "step_s": t_inner + control + across, "inner_s": t_inner, "across_s": across,
                     "control_s": control, "bytes_per_step": v.outer_bytes * params / v.inner_steps, "variant": v})
    return rows


def pays_below(pb: Problem, inner: Prediction, replicas: int, latency: float, variant: Variant) -> float | None:
    """The inter-site bandwidth (bytes/s) below which `variant` is PAYS_MARGIN faster per step than
    per-step sync; None when it is not even at 1 Mbit/s (latency-bound: H too small for it)."""
    def gain(bw: float) -> float:
        sync, dl = step_times(pb, inner, replicas, bw, latency, [variant])
        return sync["step_s"] / dl["step_s"] - (1 + PAYS_MARGIN)

    lo, hi = 1.25e5, 1e14  # 1 Mbit/s .. 800 Tbit/s
    if gain(lo) <= 0:
        return None
    if gain(hi) > 0:
        return hi
    for _ in range(60):  # bisection on a log scale; the gain falls as the bandwidth grows
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return lo


def across_report(pb: Problem, lay, bw: float, latency: float, variants: list[Variant]) -> dict:
    r = lay.dp_replicate
    for v in variants:
        # The layout rules the trainer runs (layout/diloco.py among them), on the layout it would train.
        found = problems(v.layout(lay), pb.cfg, pb.world, pb.seq, pb.global_batch, pb.strict)
        if found:
            hint = " (the replicas are the sites: give --layout ...,dp_replicate=R or --fix dp_replicate=R)" \
                if r < 2 else ""
            raise NdtrainError(f"--replicas-across with {v.name()}: {found[0].key}: {found[0]}{hint}")
    inner = replica_prediction(pb, lay)
    rows = step_times(pb, inner, r, bw, latency, variants)
    base = rows[0]["step_s"]
    for row in rows:
        row["speedup"] = base / row["step_s"]
        v = row.pop("variant", None)
        if v is not None:
            row["pays_below_bytes_per_s"] = pays_below(pb, inner, r, latency, v)
    return {"replicas": r, "bandwidth_bytes_per_s": bw, "latency_s": latency, "layout": lay.short(),
            "replica_layout": inner.layout.short(), "rows": rows}


def _bw(x: float | None) -> str:
    if x is None:
        return "never (latency-bound)"
    bits = x * 8
    for div, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s")):
        if bits >= div:
            return f"{bits / div:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def across_text(rep: dict) -> str:
    lines = ["", f"Replicas across a slower network: {rep['replicas']} sites of {rep['replica_layout']}, "
                 f"{_bw(rep['bandwidth_bytes_per_s'])} and {rep['latency_s'] * 1e3:.3g} ms between sites"]
    for row in rep["rows"]:
        pays = "" if "pays_below_bytes_per_s" not in row else \
            f"   pays below {_bw(row['pays_below_bytes_per_s'])}"
        lines.append(f"  {row['name']:<34} step {row['step_s']:8.3f} s = replica {row['inner_s']:.3f} s + "
                     f"across sites {row['across_s']:.3f} s + control {row['control_s']:.3f} s;  "
                     f"{row['bytes_per_step'] / 1e9:.3g} GB/step across, {row['speedup']:.2f}x{pays}")
    lines.append(f"  (\"pays\": at least {PAYS_MARGIN:.0%} faster per step than per-step sync; DiLoCo needs "
                 f"somewhat more tokens for the same loss, see docs/diloco.md)")
    return "\n".join(lines)
