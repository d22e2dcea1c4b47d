"""Uneven data-parallel batch shares without a process group: the split's arithmetic, the
loader's exactly-once stream across changed shares and layouts, the measured re-balancing
decision (injected per-rank times, no clock), balance = "plan"'s weights, and the config's
refusals. (Gradient parity with one process: tests/parallel/test_uneven_shares.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from ndtrain.config import load_config
from ndtrain.errors import ConfigError
from ndtrain.layout.batch_shares import (BatchSplit, make_split, micro_sizes, rebalance, share_rows,
                                         shares_problem)


# ---- the arithmetic --------------------------------------------------------------------------
def test_rows_follow_the_weights_and_sum_to_the_batch():
    assert share_rows(16, [1, 1]) == [8, 8]  # equal weights: the equal split
    assert share_rows(16, [3, 1]) == [12, 4]
    assert share_rows(10, [2, 1]) == [7, 3]  # 6.67 / 3.33: the larger remainder takes the row
    assert share_rows(7, [1, 1, 1]) == [3, 2, 2]  # ties go to the lower rank
    for gb in range(3, 40):
        rows = share_rows(gb, [0.61, 0.27, 0.12])
        assert sum(rows) == gb and all(abs(r - gb * w) < 1 for r, w in zip(rows, [0.61, 0.27, 0.12]))


def test_every_rank_runs_the_same_number_of_micro_batches():
    split = make_split(16, [3, 1], rank=0, micro_batch=4)  # rows [12, 4]: 3 micro-batches of 4 on rank 0
    assert split.rows == (12, 4) and split.micro_batches == 3
    assert split.slices() == [(0, 4), (4, 8), (8, 12)]
    slow = make_split(16, [3, 1], rank=1, micro_batch=4)
    assert slow.slices() == [(0, 2), (2, 3), (3, 4)]  # the same 3 micro-batches, smaller
    assert micro_sizes(7, 3) == [3, 2, 2]


def test_the_normaliser_makes_the_rank_average_the_global_token_mean():
    """Rank r divides its loss sum by its tokens x norm_scale; the data-parallel average of those
    is sum(losses) / global tokens whatever the rows."""
    rows, seq = (12, 4, 7), 5
    losses = [3.0, 11.0, 2.5]  # each rank's summed token loss
    mean = sum(loss / (r * seq * BatchSplit(rows, i, 1).norm_scale) for i, (loss, r) in enumerate(zip(losses, rows))) / 3
    assert mean == pytest.approx(sum(losses) / (sum(rows) * seq), rel=1e-12)


def test_refusals_name_what_is_wrong():
    assert "data-parallel degree is 2" in shares_problem([1, 1, 1], 2, [8], 4)
    assert "positive" in shares_problem([1, -1], 2, [8], 4)
    # rows [15, 1] at micro_batch 4: 4 micro-batches, rank 1 has one row
    assert "rank 1 1 of the 16 rows" in shares_problem([15, 1], 2, [16], 4)
    assert shares_problem([15, 1], 2, [16], 16) is None
    assert shares_problem([5, 1], 2, [12], 5) is None  # rows [10, 2]: 2 micro-batches
    assert "of the 9 rows" in shares_problem([5, 1], 2, [12, 9], 5)  # every batch of a ramp: [8, 1] at 9


# ---- the loader: exactly once across changed shares and layouts ---------------------------------
class _Tokens:
    """A stand-in dataset: token t at offset t (each window names its own position)."""

    split = "train"

    def __init__(self, n: int):
        self.n = n

    def num_samples(self, seq_len: int) -> int:
        return (self.n - 1) // seq_len

    def windows(self, indices, seq_len):
        import torch

        offsets = indices[:, None] * seq_len + np.arange(seq_len + 1)
        chunk = torch.from_numpy(offsets)
        return chunk[:, :-1], chunk[:, 1:]

    def describe(self) -> str:
        return "tokens"


def _loaders(state, dp, weights, micro=4):
    from ndtrain.data.loader import StatefulLoader

    out = []
    for r in range(dp):
        loader = StatefulLoader(_Tokens(4 * 200 + 1), seq_len=4, seed=7, dp_rank=r, dp_size=dp)
        loader.set_shares(weights, micro, make_split)
        if state is not None:
            loader.load_state_dict(state)
        out.append(loader)
    return out


def _steps(loaders, gb, n, prefetch=False):
    ids = []
    for loader in loaders:
        if prefetch:
            loader.start_prefetch(2)
    for _ in range(n):
        step = [loader.next_batch(gb) for loader in loaders]
        rows = [b.global_ids.numel() for b in step]
        ids += [int(i) for b in step for i in b.global_ids]
        if step[0].split is not None:
            assert tuple(rows) == step[0].split.rows
    return ids


def test_every_sample_once_and_in_order_across_a_resume_with_other_shares():
    first = _loaders(None, 2, [3, 1])
    seen = _steps(first, 8, 3, prefetch=True)
    first[0].set_shares([1, 3], 4, make_split)  # a re-balance mid-run (prefetched batches are dropped)
    first[1].set_shares([1, 3], 4, make_split)
    seen += _steps(first, 8, 2)
    state = first[0].state_dict()
    for loader in first:
        loader.close()
    seen += _steps(_loaders(state, 3, [0.5, 0.3, 0.2]), 10, 2)  # resumed on 3 ranks, other weights
    state = _loaders(state, 1, None)[0].state_dict()
    seen += _steps(_loaders(dict(state, consumed_samples=60), 2, None), 8, 1)  # equal slices again
    assert seen == list(range(68))


def test_uneven_rows_per_rank_are_contiguous_slices_of_the_step_block():
    loaders = _loaders(None, 2, [3, 1])
    a, b = (loader.next_batch(16) for loader in loaders)
    assert a.global_ids.tolist() == list(range(12)) and b.global_ids.tolist() == list(range(12, 16))


# ---- balance = "measured": the decision, from injected per-rank times --------------------------
def test_a_slow_rank_gets_rows_in_proportion_to_its_speed():
    # rank 1 takes twice as long per row: rows per busy second 8/1 and 8/2
    d = rebalance([8, 8], [1.0, 2.0], threshold=0.1)
    assert d.weights == [0.6667, 0.3333] and d.imbalance == pytest.approx(2 / 1.5 - 1)
    assert share_rows(16, d.weights) == [11, 5]
    # after the change the step times nearly agree (11 x 1/8 vs 5 x 2/8): no second change
    assert rebalance([11, 5], [11 / 8, 10 / 8], threshold=0.1) is None


def test_no_change_within_the_threshold_or_without_a_time():
    assert rebalance([8, 8], [1.0, 1.15], threshold=0.1) is None  # 1.07x the mean
    assert rebalance([8, 8], [1.0, 1.15], threshold=0.05) is not None
    assert rebalance([8, 8], [1.0, 0.0], threshold=0.1) is None  # a rank measured nothing
    assert rebalance([16], [3.0], threshold=0.1) is None


def test_the_straggler_monitor_compares_busy_time_at_the_mean_share():
    """A rank given 12 of 16 rows is busy 1.5x the mean share's time by design: not a straggler."""
    import torch
    from types import SimpleNamespace

    from ndtrain.train.balance import busy_at_mean_rows

    fast = _loaders(None, 2, [3, 1])[0]
    result = SimpleNamespace(sample_ids=torch.arange(12), extra={"global_batch": 16})
    assert busy_at_mean_rows(1.5, fast, result) == pytest.approx(1.0)
    assert busy_at_mean_rows(lambda: 3.0, fast, result)() == pytest.approx(2.0)  # a CUDA timer's lazy read
    equal = _loaders(None, 2, None)[0]
    assert busy_at_mean_rows(1.5, equal, SimpleNamespace(sample_ids=torch.arange(8), extra={"global_batch": 16})) == 1.5


def test_a_checkpoints_shares_for_another_layout_are_dropped_with_a_line():
    from types import SimpleNamespace

    from ndtrain.layout import Layout
    from ndtrain.train.balance import Balancer
    from ndtrain.train.checkpoint import TrainProgress

    loader = _loaders(None, 2, [3, 1])[0]
    progress = TrainProgress(step=5, batch_shares=[0.5, 0.3, 0.2])  # saved by a run on 3 ranks
    cfg = load_config(None, {"parallel": {"balance": "measured", "batch_shares": [3, 1]}, "train": {"micro_batch": 4}})
    bal = object.__new__(Balancer)  # its clock needs a model; sync reads the state only
    bal.state = SimpleNamespace(progress=progress, dp_size=2, loader=loader, cfg=cfg, layout=Layout(dp_shard=2, micro_batch=4))
    bal.initial, bal.clock, bal.since = [3.0, 1.0], SimpleNamespace(take=lambda: 0.0), 0
    assert "for 3 data-parallel ranks, this run has 2" in bal.sync()
    assert progress.batch_shares is None and loader.shares == ([3.0, 1.0], 4)
    progress.batch_shares = [0.25, 0.75]  # a rollback to a checkpoint that recorded a re-balance
    assert bal.sync() is None and loader.shares == ([0.25, 0.75], 4)
    resumed = TrainProgress()
    resumed.load_state_dict(progress.state_dict())  # the checkpoint keeps the decided shares
    assert resumed.batch_shares == [0.25, 0.75]
    older = {k: v for k, v in progress.state_dict().items() if k != "batch_shares"}
    resumed.load_state_dict(older)  # a checkpoint from before the key: the config's shares
    assert resumed.batch_shares is None


# ---- balance = "plan" -------------------------------------------------------------------------
# Big enough per rank for the planner to see the kinds' peaks (the tiny model's step is overheads).
PLANNED = {"model": {"preset": "llama3-1b"}, "data": {"seq_len": 2048}, "train": {"global_batch": 64, "micro_batch": 4}}


def test_plan_weights_favour_the_faster_kind_in_rank_order():
    from ndtrain.layout import Layout
    from ndtrain.train.balance import plan_weights

    cfg = load_config(None, {**PLANNED, "parallel": {"balance": "plan", "gpus": "1xa100-80,1xh100"}})
    w = plan_weights(cfg, Layout(dp_replicate=2, micro_batch=4), dp=2)
    assert w[1] == 1.0 and 0.25 < w[0] < 0.5  # the H100 (rank 1) is the fast one
    with pytest.raises(ConfigError, match="names 2 data-parallel ranks but the data-parallel degree is 4"):
        plan_weights(cfg, Layout(dp_replicate=4), dp=4)
    bad = load_config(None, {"parallel": {"balance": "plan", "gpus": "1xh100,one a100"}})
    with pytest.raises(ConfigError, match="parallel.gpus.*bad item 'one a100'"):
        plan_weights(bad, Layout(dp_replicate=2), dp=2)


def test_a_run_starts_with_the_shares_its_balance_mode_names():
    from ndtrain.layout import Layout
    from ndtrain.train.balance import initial_weights

    lay = Layout(dp_replicate=2, micro_batch=4)
    assert initial_weights(load_config(None, {}), lay, 2) is None  # equal slices
    given = load_config(None, {"parallel": {"batch_shares": [3, 1]}, "train": {"global_batch": 16, "micro_batch": 8}})
    assert initial_weights(given, lay, 2) == [3.0, 1.0]
    planned = load_config(None, {**PLANNED, "parallel": {"balance": "plan", "gpus": "1xh100,1xa100-80"}})
    w = initial_weights(planned, lay, 2)
    assert w[0] == 1.0 and 0.25 < w[1] < 0.5  # an A100 at about a third of an H100 (bf16 peaks 312 / 989)
    # 4 rows at micro_batch 1: [3, 1], 3 micro-batches each, and the A100's rank has one row
    tight = load_config(None, {**PLANNED, "train": {"global_batch": 4, "micro_batch": 1},
                               "parallel": {"balance": "plan", "gpus": "1xh100,1xa100-80"}})
    with pytest.raises(ConfigError, match="fewer than the 3 micro-batches") as exc:
        initial_weights(tight, Layout(dp_replicate=2, micro_batch=1), 2)
    assert exc.value.key == "parallel.gpus"


def test_the_planners_uneven_stage_split_is_what_the_runtime_partitions():
    """layout/partition.py already takes an explicit split (layers_per_stage): the planner's stage
    shares for a mixed pool run as planned."""
    from ndtrain.layout import Layout
    from ndtrain.layout.partition import pipeline_split
    from ndtrain.model.config import PRESETS, ModelConfig

    cfg = ModelConfig(preset="tiny", **PRESETS["tiny"])
    counts = [3, 3, 1, 1]  # what stage shares give a fast kind's two stages and a slow kind's two
    assert sum(counts) == cfg.n_layers
    lay = Layout(pp=4, layers_per_stage=tuple(counts))
    assert pipeline_split(cfg, 64, lay) == counts


# ---- the config's refusals ----------------------------------------------------------------------
@pytest.mark.parametrize("over, key", [
    ({"parallel": {"batch_shares": [2, 0]}}, "parallel.batch_shares"),
    ({"parallel": {"batch_shares": [2, 1], "pp": 2}}, "parallel.batch_shares"),
    ({"parallel": {"balance": "measured"}, "train": {"batch_ramp": "auto", "batch_auto_max": 64}}, "parallel.balance"),
    ({"parallel": {"balance": "plan"}}, "parallel.gpus"),
    ({"parallel": {"balance": "plan", "gpus": "2xh100", "batch_shares": [1, 1]}}, "parallel.batch_shares"),
    ({"parallel": {"balance": "sometimes"}}, "parallel.balance"),
    ({"parallel": {"balance_threshold": 0}}, "parallel.balance_threshold"),
])
def test_bad_share_settings_are_refused_naming_the_key(over, key):
    with pytest.raises(ConfigError) as exc:
        load_config(None, over)
    assert exc.value.key == key


def test_shares_that_do_not_fit_the_world_stop_the_command_in_one_line(tmp_path, corpus_dir, capsys):
    from ndtrain.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc = main(["train", "--model.preset=debug", f"--data.path={corpus_dir}", "--data.seq_len=32", "--train.steps=1",
               "--parallel.compile=false", "--logging.tensorboard=false", "--logging.progress=off",
               f"--train.output_dir={out}", "--parallel.batch_shares=[3, 1]"])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "parallel.batch_shares" in lines[0] and "data-parallel degree is 1" in lines[0], err
    assert (out / "notes.txt").read_text() == "mine"


def test_config_check_and_the_launchers_resolve_refuse_shares_for_another_world():
    from ndtrain.parallel.dims import checked_layout
    from ndtrain.tools.config_check import check_config

    cfg = load_config(None, {"parallel": {"batch_shares": [3, 1]}, "train": {"global_batch": 16, "micro_batch": 8}})
    with pytest.raises(ConfigError, match="has 2 entries but the data-parallel degree is 4") as exc:
        check_config(cfg, 4, build=False)
    assert exc.value.key == "parallel.batch_shares"
    with pytest.raises(ConfigError, match="data-parallel degree is 4"):
        checked_layout(cfg.parallel, 4, cfg.model, cfg.data.seq_len, cfg.train)  # what `train --nproc 4` resolves first
    assert checked_layout(cfg.parallel, 2, cfg.model, cfg.data.seq_len, cfg.train).dp == 2
    check_config(cfg, 2, build=False)
