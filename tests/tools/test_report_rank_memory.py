"""Every rank's peak memory reaches the report in a run shorter than one straggler window: the
last step gathers it (before, such a run drew rank 0 alone)."""

from __future__ import annotations

import pytest

from ndtrain.config import load_config
from ndtrain.tools.report_plots import per_rank_memory
from ndtrain.tools.run_data import read_run


def _rank_train(cfg):
    from ndtrain.train.trainer import train

    return train(cfg)["steps"]


@pytest.mark.timeout(180)
def test_a_run_shorter_than_the_straggler_window_draws_every_rank(parity_base, tmp_path, hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    base = {k: dict(v) for k, v in parity_base.items()}
    base["parallel"] = {"dp_shard": 2}
    base["train"].update(steps=3, straggler_window=20, val_interval=0, sample_tokens=0, output_dir=str(tmp_path / "run"))
    assert run_ranks(2, _rank_train, load_config(None, base), timeout_s=hang_deadline(150)) == [3, 3]
    run = read_run(tmp_path / "run")
    assert [(r["step"], len(r["rank_peak_memory_mb"])) for r in run.ranks] == [(3, 2)]
    memory = per_rank_memory(run)
    assert len(memory) == 2 and all(m > 0 for m in memory), memory
