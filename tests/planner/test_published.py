"""The model against published runs: Megatron-LM Table 1 (fitted), Llama 3 (fitted / held out)."""

import pytest

from ndtrain.planner.hardware import A100_KAPPA, A100_MM_EFF, H100_MM_EFF
from ndtrain.planner.published import (LLAMA3_TABLE4, TABLE1, fit_a100, fit_h100, predict_llama3, predict_row,
                                       table1_problem)
from ndtrain.planner.search import search


@pytest.mark.parametrize("row", TABLE1, ids=[f"{r.params_b}B" for r in TABLE1])
def test_table1_row_within_15_percent(row):
    pred, tflops = predict_row(row)
    assert pred.fits
    assert tflops == pytest.approx(row.tflops, rel=0.15), f"{row.params_b}B: {tflops:.1f} vs {row.tflops}"
    lay = pred.layout
    assert (lay.tp, lay.pp, lay.dp_replicate, lay.ac) == (row.tp, row.pp, row.dp, "full")


@pytest.mark.parametrize("row", TABLE1, ids=[f"{r.params_b}B" for r in TABLE1])
def test_planner_top_layout_beats_published_and_fits(row):
    published, _ = predict_row(row)
    res = search(table1_problem(row), top_k=1)
    top = res.top[0]
    assert top.fits and top.memory["total"] <= 80 * 2**30
    assert top.step_time <= published.step_time * (1 + 1e-9)


def test_pinned_constants_are_the_fit():
    eff, kappa, worst = fit_a100(mm_grid=[0.615, 0.62, 0.625, 0.63, 0.635], kappa_grid=[4.5, 5.0, 5.5])
    assert (eff, kappa) == (A100_MM_EFF, A100_KAPPA)
    assert worst < 0.05
    eff, worst = fit_h100(grid=[0.565, 0.57, 0.575, 0.58, 0.585])
    assert eff == H100_MM_EFF and worst < 0.02


def test_llama3_405b():
    errs = [predict_llama3(row)[1] / row[-1] - 1 for row in LLAMA3_TABLE4]
    assert abs(errs[0]) < 0.02 and abs(errs[1]) < 0.02  # fitted
    assert abs(errs[2]) < 0.20  # 131K tokens with cp=16: held out


def test_deepseek_v3_out_of_sample():
    from ndtrain.planner.published import DEEPSEEK_V3, predict_deepseek_v3

    pred, per_gpu = predict_deepseek_v3()
    assert pred.fits
    assert per_gpu == pytest.approx(DEEPSEEK_V3["tokens_per_s_per_gpu"], rel=0.25)
