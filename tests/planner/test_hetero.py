"""Planning a pool of two GPU kinds: batch shares and stage shares against the uniform split and
the best one-kind subset (planner/hetero.py, `ndtrain plan --gpus 64xh100,64xa100`)."""

import io
import json
from contextlib import redirect_stdout

import pytest

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout
from ndtrain.planner.command import plan_main
from ndtrain.planner.hetero import Pool, _balanced_counts, parse_pool, stage_shares, uniform
from ndtrain.planner.problem import make_problem
from ndtrain.planner.shapes import resolve_model


def test_parse_pool_orders_fastest_first_and_merges_kinds():
    assert parse_pool("64xa100, 32xh100,32Xh100-sxm") == [("h100", 64), ("a100-80", 64)]


@pytest.mark.parametrize("text, needle", [("64xh100,,x", "'x'"), ("0xh100", "positive count"),
                                          ("8xnosuchgpu", "nosuchgpu"), ("h100", "'h100'")])
def test_parse_pool_refuses_in_one_line(text, needle):
    with pytest.raises(NdtrainError) as err:
        parse_pool(text)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_balanced_counts_give_slower_stages_fewer_layers():
    counts = _balanced_counts(80, [1.0, 1.0, 3.0, 3.0])
    assert sum(counts) == 80 and counts[0] == counts[1] and counts[2] == counts[3]
    assert counts[0] == 30 and counts[2] == 10  # inverse proportion, exactly here
    assert _balanced_counts(3, [1.0] * 4) is None


def _pool(batch=256):
    cfg = resolve_model("llama3-70b", None)
    return Pool(parse_pool("64xh100,64xa100"), lambda kind, world, b: make_problem(cfg, 8192, b or batch, world, kind))


def test_stage_shares_beat_the_uniform_split_of_the_same_layout():
    pool = _pool()
    lay = Layout(dp_shard=4, tp=8, pp=4, zero=1, reshard_after_forward=False, micro_batch=1, activation_checkpoint="full", sequence_parallel=True, mixed_precision="bf16")
    even, mixed = uniform(pool, lay), stage_shares(pool, lay)
    assert mixed.shares["h100"]["layers_per_stage"] == [29, 29] and mixed.shares["a100-80"]["layers_per_stage"] == [11, 11]
    # the critical stage drops from an A100 stage of 20 layers to an H100 stage of 29 at ~3x the speed
    assert 1.4 < even.step_time / mixed.step_time < 2.0


def test_plan_json_has_the_contract_keys_and_the_mixed_plan_wins():
    out = io.StringIO()
    with redirect_stdout(out):
        rc = plan_main(["--model", "llama3-8b", "--gpus", "64xh100,64xa100", "--global-batch", "512", "--json"])
    assert rc == 0
    doc = json.loads(out.getvalue())
    best = doc["layouts"][0]
    uni, sub = doc["baselines"]["uniform"], doc["baselines"]["best_subset"]
    assert best["tokens_per_s"] > 1.3 * uni["tokens_per_s"]  # the A100s hold the uniform split back ~3x
    assert best["tokens_per_s"] > sub["tokens_per_s"]  # the A100s add work beyond the H100s alone
    assert best["kind"] in ("batch_shares", "stage_shares")
    if best["kind"] == "batch_shares":
        shares = best["shares"]
        assert shares["h100"]["micro_batch"] > shares["a100-80"]["micro_batch"]
        assert shares["h100"]["micro_batches"] == shares["a100-80"]["micro_batches"]
        assert 64 * (shares["h100"]["micro_batch"] + shares["a100-80"]["micro_batch"]) * shares["h100"]["micro_batches"] \
            // (best["layout"]["tp"] * best["layout"]["cp"] * best["layout"]["pp"]) == 512
    assert list(sub["shares"]) == ["h100"]


def test_plan_pool_refuses_what_it_does_not_plan_in_one_line():
    with pytest.raises(NdtrainError, match="--layout is not planned for a mixed pool"):
        plan_main(["--model", "llama3-8b", "--gpus", "8xh100,8xa100", "--global-batch", "64", "--layout", "tp=2"])


def test_the_text_report_keeps_one_column_for_every_layout():
    """The ranked, uniform and best-subset lines put their tokens/s at one column, however long a
    layout's description (a pipeline's reads pp_schedule=... pp_virtual_stages=...)."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert plan_main(["--model", "llama3-8b", "--gpus", "8xh100,8xa100-80", "--seq", "4096",
                          "--global-batch", "64", "--samples", "0"]) == 0
    rows = [line for line in out.getvalue().splitlines() if " tokens/s" in line]
    assert len(rows) >= 3 and any("pp_schedule=" in r for r in rows), rows
    ends = {r.index(" tokens/s") for r in rows}
    assert len(ends) == 1, rows
