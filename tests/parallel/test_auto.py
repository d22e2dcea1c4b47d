"""`[parallel] auto`: the planner's choice is a layout the runtime accepts for that world size."""

from __future__ import annotations

import pytest

from ndtrain.config import load_config
from ndtrain.tools.auto import apply_auto_layout, describe
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


def test_the_whole_choice_reaches_the_runtime():
    """Degrees, ZeRO stage, schedule, v, pipeline micro-batches, stage split, recompute and the
    micro-batch: the config after auto is exactly the planner's layout."""
    from ndtrain.layout import from_config

    cfg = load_config(None, {"model": {"preset": "llama3-8b"}, "data": {"seq_len": 8192},
                             "parallel": {"auto": True, "auto_hardware": "h100"},
                             "train": {"global_batch": 64, "micro_batch": 1}})
    choice = apply_auto_layout(cfg, 64)
    assert from_config(cfg.parallel, cfg.train) == choice["layout"]
    lay = choice["layout"]
    if lay.pp > 1:
        assert sum(cfg.parallel.layers_per_stage) == 32 and cfg.parallel.pp_microbatches == lay.m > 0
    assert resolve(cfg.parallel, 64, cfg.model, cfg.data.seq_len, cfg.train) == lay
    assert choice["hardware"] == "h100"


def test_auto_plans_for_the_gpu_it_finds(monkeypatch):
    import torch

    from ndtrain.errors import NdtrainError
    from ndtrain.tools.auto import auto_hardware
    from ndtrain.planner.hardware import catalog_name

    assert catalog_name("NVIDIA H100 80GB HBM3") == "h100"
    assert catalog_name("NVIDIA A100-SXM4-40GB") == "a100-40"
    assert catalog_name("NVIDIA A100-SXM4-80GB") == "a100-80"
    assert catalog_name("NVIDIA A100 PCIe", 40 * 2**30) == "a100-40"
    assert catalog_name("NVIDIA H200") == "h200" and catalog_name("Tesla T4") is None

    cfg = load_config(None, {"parallel": {"auto": True}})
    assert auto_hardware(cfg) is None  # no GPU here: the calibrated CPU profile
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: type("P", (), {"total_memory": 80 * 2**30}))
    assert auto_hardware(cfg) == "h100"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla T4")
    with pytest.raises(NdtrainError, match="auto_hardware"):
        auto_hardware(cfg)
    cfg.parallel.auto_hardware = "a100-80"  # the config key overrides what is found
    assert auto_hardware(cfg) == "a100-80"


def test_the_trainer_without_the_planner_refuses_auto_with_the_key(capsys):
    """The planner sits above the trainer: a caller that hands no `plan` gets one line, not a guess."""
    from ndtrain.errors import ConfigError
    from ndtrain.train.trainer import plan_layout

    cfg = load_config(None, {"parallel": {"auto": True}})
    with pytest.raises(ConfigError, match="parallel.auto"):
        plan_layout(cfg, 2)
    assert plan_layout(load_config(None, {}), 2) is None
    choice = plan_layout(cfg, 2, apply_auto_layout)
    assert choice["description"] == describe(choice)
