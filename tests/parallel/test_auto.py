"""`[parallel] auto`: the planner's choice is a layout the runtime accepts for that world size."""

from __future__ import annotations

import pytest

from ndtrain.config import load_config
from ndtrain.parallel.auto import apply_auto_layout, describe
from ndtrain.parallel.dims import resolve


def test_auto_off_changes_nothing():
    cfg = load_config(None, {"parallel": {"tp": 2}})
    assert apply_auto_layout(cfg, 4) is None and cfg.parallel.tp == 2


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_auto_layout_is_buildable(world):
    cfg = load_config(None, {"parallel": {"auto": True}, "train": {"global_batch": 16, "micro_batch": 4},
                             "data": {"seq_len": 128}})
    choice = apply_auto_layout(cfg, world)
    dims = resolve(cfg.parallel, world, cfg.model, cfg.data.seq_len, cfg.train)
    assert dims.world_size == world
    assert cfg.train.global_batch % (dims.dp * cfg.train.micro_batch) == 0
    assert choice["predicted_step_time"] > 0 and "predicted" in describe(choice)
