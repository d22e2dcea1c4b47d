"""The planner's price of a ramped run: each batch's step time over the tokens it trains."""

from __future__ import annotations

import json

import pytest

from ndtrain.errors import NdtrainError
from ndtrain.planner.batch_ramp import parse_ramp, price, segments


def test_segments_follow_the_runtime_rule():
    # base 8 until 100 tokens, 16 until 300, then 32; a threshold at 0 replaces the base batch
    assert segments(1000, 8, [[300, 32], [100, 16]]) == [(8, 100), (16, 200), (32, 700)]
    assert segments(1000, 8, [[0, 4], [500, 16]]) == [(4, 500), (16, 500)]
    assert segments(200, 8, [[100, 16], [300, 32]]) == [(8, 100), (16, 100)]  # the budget ends first
    assert segments(50, 8, []) == [(8, 50)]


def test_price_is_time_weighted():
    seq = 10
    step_s = {8: 1.0, 16: 1.5}  # the bigger batch runs at 16*10/1.5 tokens/s
    out = price(1600, 8, [[800, 16]], seq, step_s.__getitem__)
    assert out["steps"] == pytest.approx(800 / 80 + 800 / 160)
    assert out["seconds"] == pytest.approx(10 * 1.0 + 5 * 1.5)
    assert out["tokens_per_s"] == pytest.approx(1600 / 17.5)
    fixed = price(1600, 8, [], seq, step_s.__getitem__)
    assert fixed["seconds"] == pytest.approx(20.0) and len(fixed["segments"]) == 1


@pytest.mark.parametrize("text", ["[[1]]", "nope", "[[0, 0]]", "[[-1, 8]]", "[[0, 1.5]]", "{}"])
def test_bad_ramp_is_one_clear_error(text):
    with pytest.raises(NdtrainError, match="--batch-ramp must be"):
        parse_ramp(text)


def test_plan_prices_a_ramped_run(capsys):
    from ndtrain.cli import main as cli

    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--top", "1", "--tokens", "1B"]
    assert cli(args + ["--json", "--batch-ramp", "[[0, 32], [500000000, 64]]"]) == 0
    out = json.loads(capsys.readouterr().out)
    ramp, fixed = out["batch_ramp"], out["layouts"][0]
    assert [s["global_batch"] for s in ramp["segments"]] == [32, 64]
    assert sum(s["tokens"] for s in ramp["segments"]) == pytest.approx(1e9)
    assert ramp["segments"][1]["step_s"] == pytest.approx(fixed["step_time_s"], rel=1e-9)  # the layout's own batch
    assert ramp["seconds"] == pytest.approx(sum(s["seconds"] for s in ramp["segments"]))
    assert cli(args + ["--batch-ramp", "[[0]]"]) == 2
    err = capsys.readouterr().err
    assert "--batch-ramp must be" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
