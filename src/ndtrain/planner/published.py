"""The model against published runs (planner/published_data.py): predictions, errors, and the
fits of the few constants that are fitted, each on its own rows only.

Fitting discipline: a constant is fitted per GPU generation (or per kind of kernel), on the rows
marked "fit", never per row; the "validation" rows are never used to choose a value. The fitted
values are pinned in planner/constants.py and tests check they are still the optimum of these
fits (`fit_ampere`, `fit_hopper`, `fit_hopper_fp8`).

    python -m ndtrain.planner.published        # the fitted and validation tables
"""

from __future__ import annotations

import math
import sys

from ndtrain.layout.flops import flops_per_token, recompute_flops_per_token
from ndtrain.model.config import ModelConfig
from ndtrain.planner.hardware import get_hardware
from ndtrain.planner.problem import make_problem
from ndtrain.planner.published_data import ROWS, SOURCES, Row
from ndtrain.planner.search import Prediction, search
from ndtrain.planner.shapes import resolve_model
from ndtrain.planner.uncertainty import assess

# ZeRO paper, section 5 example: 7.5B parameters, N_d = 64, K = 12 -> GB per device.
ZERO_EXAMPLE = {"params": 7.5e9, "dp": 64, "gb": {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}}


def row_model(row: Row) -> ModelConfig:
    return resolve_model(None, row.model) if "=" in row.model else resolve_model(row.model, None)


def row_problem(row: Row, constants: dict | None = None):
    return make_problem(row_model(row), row.seq, row.batch, row.gpus, row.gpu, stack=row.stack,
                        precision=row.precision, strict=False, constants=constants, network=row.network or None)


def megatron_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh), FLOPs per step including
    the recomputed forward pass. For their GPT shapes it is exactly ndtrain's count with full
    attention plus full recompute (tested)."""
    return batch * seq * (flops_per_token(cfg, seq, "full") + recompute_flops_per_token(cfg, seq, "full", "full"))


def metric(row: Row, pred: Prediction, cfg: ModelConfig) -> float:
    """The prediction in the row's published metric."""
    tokens = row.batch * row.seq
    if row.metric == "step_s":
        return pred.step_time
    if row.metric == "tokens_per_gpu":
        return tokens / pred.step_time / row.gpus
    if row.metric == "tflops_megatron":
        return megatron_flops(cfg, row.batch, row.seq) / pred.step_time / row.gpus / 1e12
    if row.metric == "tflops_causal":
        return flops_per_token(cfg, row.seq, "causal") * tokens / pred.step_time / row.gpus / 1e12
    raise ValueError(f"unknown metric {row.metric!r}")


def predict_row(row: Row, constants: dict | None = None) -> tuple[Prediction, float]:
    """(best completion of the published layout, the prediction in the row's metric)."""
    pb = row_problem(row, constants)
    res = search(pb, top_k=1, fixed=dict(row.fixed), mb_options=list(row.mb) or None)
    if not res.top:
        over = res.fastest_over_cap
        raise RuntimeError(f"{row.name}: the published layout does not fit"
                           + (f" ({over.memory['total'] / 2**30:.1f} GiB)" if over else ""))
    return res.top[0], metric(row, res.top[0], pb.cfg)


def error(row: Row, value: float) -> float:
    """Relative error of a prediction; for step times the error of the implied throughput, so
    that every row's sign means the same (+ = the model is optimistic)."""
    if row.metric == "step_s":
        return row.published / value - 1
    return value / row.published - 1


def rows(role: str | None = None, source: str | None = None) -> list[Row]:
    return [r for r in ROWS if (role is None or r.role == role) and (source is None or r.source == source)]


def errors(selected: list[Row], constants: dict | None = None) -> list[float]:
    return [error(r, predict_row(r, constants)[1]) for r in selected]


def _grid_fit(selected: list[Row], grids: dict[str, list[float]]) -> tuple[dict, float]:
    """The grid point minimising the worst relative error over `selected` rows."""
    names = list(grids)
    best: tuple[dict, float] | None = None

    def walk(i, chosen):
        nonlocal best
        if i == len(names):
            worst = max(abs(e) for e in errors(selected, chosen))
            if best is None or worst < best[1]:
                best = (dict(chosen), worst)
            return
        for value in grids[names[i]]:
            walk(i + 1, {**chosen, names[i]: value})

    walk(0, {})
    return best


def fit_ampere(gemm=None, kappa=None) -> tuple[dict, float]:
    """Ampere GEMM ceiling and the eager elementwise traffic, on Megatron-LM 2021 Table 1."""
    return _grid_fit(rows("fit", "narayanan2021"), {"gemm_eff": gemm or [x / 100 for x in range(64, 86, 2)],
                                                      "kappa_eager": kappa or [3.0, 4.0, 5.0, 6.0, 7.0]})


def fit_hopper(gemm=None) -> tuple[dict, float]:
    """Hopper bf16 GEMM ceiling, on Llama 3's two 8K rows (the 131K row is validation)."""
    return _grid_fit(rows("fit", "llama3"), {"gemm_eff": gemm or [x / 100 for x in range(56, 80, 2)]})


def fit_hopper_fp8(fp8=None) -> tuple[dict, float]:
    """Hopper fp8 GEMM ceiling, on NeMo 24.07's LLAMA2-7B fp8 row (one node, no model parallelism)."""
    return _grid_fit(rows("fit", "nemo2407"), {"fp8_gemm_eff": fp8 or [x / 100 for x in range(40, 70, 2)]})


def table(role: str, constants: dict | None = None) -> list[dict]:
    out = []
    for r in rows(role):
        pred, value = predict_row(r, constants)
        out.append({"row": r, "predicted": value, "error": error(r, value), "layout": pred.layout.short(),
                    "fits": pred.fits, "memory_gib": pred.memory["total"] / 2**30})
    return out


def markdown(entries: list[dict]) -> str:
    lines = ["| run | source | metric | published | predicted | error | planner's completion | GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        r = e["row"]
        fmt = (lambda x: f"{x:,.0f}") if r.published >= 100 else (lambda x: f"{x:.1f}")
        lines.append(f"| {r.name} | {r.source} | {r.metric} | {fmt(r.published)} | {fmt(e['predicted'])} | "
                     f"{e['error']:+.1%} | {e['layout']} | {e['memory_gib']:.1f} |")
    within = sum(abs(e["error"]) <= 0.15 for e in entries)
    lines.append(f"\n{within} of {len(entries)} rows within ±15%; worst {max(abs(e['error']) for e in entries):.1%}")
    return "\n".join(lines)


def generation(row: Row) -> str:
    return get_hardware(row.gpu).generation


def residual_table(entries: list[dict] | None = None) -> list[tuple[str, str, str, float]]:
    """(name, stack, generation, log(predicted / published throughput)) of every validation row:
    what planner/model_error.py's RESIDUALS holds."""
    entries = entries if entries is not None else table("validation")
    return [(e["row"].name, e["row"].stack, generation(e["row"]), round(math.log1p(e["error"]), 4)) for e in entries]


def coverage(worlds: int = 32) -> list[dict]:
    """Per validation row: whether the published figure lies inside the 80% interval of its
    prediction, over sampled constants alone and with the model's error, the row's own residual
    left out (leave-one-out: the interval a new run of that stack and generation would get)."""
    out = []
    for r in rows("validation"):
        pb = row_problem(r)
        res = search(pb, top_k=1, fixed=dict(r.fixed), mb_options=list(r.mb) or None)
        pred = res.top[0]
        rob = assess(pb, res, worlds=worlds, exclude=r.name)
        # the published step: the predicted one scaled by predicted over published throughput
        published = pred.step_time * (1 + error(r, metric(r, pred, pb.cfg)))
        lo, hi = rob.interval(pred)
        mlo, mhi = rob.model_interval(pred)
        out.append({"row": r, "constants": lo <= published <= hi, "model": mlo <= published <= mhi,
                    "group": rob.error_group, "width": mhi / mlo - 1})
    return out


def coverage_text(cov: list[dict]) -> str:
    n = len(cov)
    a, b = sum(c["constants"] for c in cov), sum(c["model"] for c in cov)
    lines = [f"80% intervals, {n} validation rows, leave-one-out: the published figure lies inside the interval "
             f"over sampled constants alone for {a} ({a / n:.0%}), with the model's error for {b} ({b / n:.0%})"]
    for group in sorted({c["group"] for c in cov}):
        sel = [c for c in cov if c["group"] == group]
        lines.append(f"  {group}: {sum(c['model'] for c in sel)} of {len(sel)} inside; median width "
                     f"{sorted(c['width'] for c in sel)[len(sel) // 2]:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if "--residuals" in argv:  # the RESIDUALS table of planner/model_error.py, as Python
        for name, stack, gen, res in residual_table():
            print(f"    ({name!r}, {stack!r}, {gen!r}, {res}),")
        return 0
    for role in ("fit", "validation"):
        print(f"## {role} rows\n")
        print(markdown(table(role)))
        print()
    if "--coverage" in argv:
        print(coverage_text(coverage()))
        print()
    print("sources:")
    for key, text in SOURCES.items():
        print(f"  {key}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
