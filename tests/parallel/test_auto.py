"""`[parallel] auto`: the planner's choice is a layout the runtime accepts for that world size."""

from __future__ import annotations

import json

import pytest

from ndtrain.config import load_config
from ndtrain.tools.auto import apply_auto_layout, describe
from ndtrain.parallel.dims import resolve


def test_auto_off_changes_nothing():
    cfg = load_config(None, {"parallel": {"tp": 2, "dp_auto": False}})
    assert apply_auto_layout(cfg, 4) is None and cfg.parallel.tp == 2 and cfg.parallel.dp_shard == -1


PEERS = {"model": {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048},
         "data": {"seq_len": 256}, "train": {"global_batch": 8, "micro_batch": 4}}


@pytest.mark.parametrize("precision,chosen", [("fp32", "ddp"), ("bf16", "zero1")])
def test_defaults_choose_what_was_fastest(precision, chosen, tmp_path, monkeypatch):
    """No data-parallel key: the planner picks the flavour. For the peers' model at world 2 on CPU
    ranks it picks what trained fastest there (docs/benchmarks.md, run I), with the uncalibrated
    profile: DDP in fp32 (torch's DDP reducer overlaps its all-reduce with the backward), ZeRO-1
    in bf16 (replication runs on FSDP2's blocking all-reduce there, ZeRO-1's reduce-scatter is an
    all-to-all and its all-gather prefetched); every other knob stays as configured."""
    import ndtrain.planner.hardware as hardware

    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "none.json")  # no calibration here
    cfg = load_config(None, {**PEERS, "parallel": {"mixed_precision": precision}})
    assert cfg.parallel.dp_auto
    choice = apply_auto_layout(cfg, 2)
    par = cfg.parallel
    got = "ddp" if (par.dp_replicate, par.dp_shard) == (2, 1) else \
        f"zero{par.zero}" if (par.dp_replicate, par.dp_shard) == (1, 2) else str((par.dp_replicate, par.dp_shard))
    assert got == chosen, choice["description"]
    assert cfg.train.micro_batch == 4 and cfg.parallel.tp == 1 and cfg.parallel.pp == 1
    assert choice["description"].startswith("data parallel (defaults)")


def test_defaults_choose_by_memory_on_a_large_model():
    """Llama 3 8B on 8 H100s, seq 4096: without recompute only ZeRO-3 fits; with full recompute
    ZeRO-1 fits and, gathering once per step instead of twice, is faster."""
    def choose(ac):
        cfg = load_config(None, {"model": {"preset": "llama3-8b"}, "data": {"seq_len": 4096},
                                 "parallel": {"auto_hardware": "h100", "activation_checkpoint": ac},
                                 "train": {"global_batch": 8, "micro_batch": 1}})
        apply_auto_layout(cfg, 8)
        return cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.zero

    assert choose("none") == (1, 8, 3)
    assert choose("full") == (1, 8, 1)


@pytest.mark.parametrize("given", [{"dp_shard": 2}, {"zero": 1}, {"dp_replicate": 2, "dp_shard": 1},
                                   {"reshard_after_forward": False}, {"dp_auto": False}])
def test_a_data_parallel_key_keeps_the_users_choice(given):
    cfg = load_config(None, {**PEERS, "parallel": dict(given)})
    assert not cfg.parallel.dp_auto
    before = (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.zero)
    assert apply_auto_layout(cfg, 2) is None
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.zero) == before


def test_dp_choice_survives_a_stored_config():
    from ndtrain.config import from_dict, to_dict

    cfg = load_config(None, PEERS)
    apply_auto_layout(cfg, 2)
    again = from_dict(to_dict(cfg))
    assert again.parallel.dp_auto and (again.parallel.dp_replicate, again.parallel.dp_shard) == (2, 1)


def test_no_choice_where_the_planner_cannot_price_it(tmp_path, monkeypatch):
    import ndtrain.planner.hardware as hardware

    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "none.json")  # uncalibrated: compile unpriced
    for parallel in ({"pp": 2}, {"activation_checkpoint": "every_n"}):
        cfg = load_config(None, {**PEERS, "parallel": parallel})
        assert apply_auto_layout(cfg, 4) is None and cfg.parallel.dp_shard == -1, parallel
    assert apply_auto_layout(load_config(None, PEERS), 1) is None


# ---- compile_auto: compile the blocks when it repays its compile time within the run ----------


def calibrated_profile(tmp_path, name: str = "hardware", **measured) -> str:
    """A CPU profile as `ndtrain calibrate` writes it (what it lacks takes the defaults)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"description": "a calibrated test host", **measured}))
    return str(path)


def test_giving_compile_keeps_the_users_choice():
    from ndtrain.config import from_dict, to_dict

    assert load_config(None, {}).parallel.compile_auto
    for given in ({"compile": False}, {"compile": True}, {"compile_auto": False}):
        assert not load_config(None, {"parallel": dict(given)}).parallel.compile_auto, given
    both = load_config(None, {"parallel": {"compile": False, "compile_auto": True}})
    assert both.parallel.compile_auto
    assert from_dict(to_dict(load_config(None, {}))).parallel.compile_auto  # a stored config decides again


def test_compile_auto_decides_for_the_run_length(tmp_path):
    profile = calibrated_profile(tmp_path)
    def run(steps, **parallel):
        cfg = load_config(None, {**PEERS, "train": {**PEERS["train"], "steps": steps},
                                 "parallel": {"auto_hardware": profile, **parallel}})
        return cfg, apply_auto_layout(cfg, 2)

    cfg, short = run(35)
    assert not cfg.parallel.compile and not short["compile"]["compile"]
    assert short["description"].startswith("data parallel (defaults)")  # the layout was chosen too
    n = short["compile"]["breakeven_steps"]
    cfg, long = run(n + 1)
    assert cfg.parallel.compile and long["compile"]["compile"] and "torch.compile on" in long["compile"]["description"]
    assert long["predicted_step_time"] == long["compile"]["compiled_step_s"] < short["predicted_step_time"]
    cfg, kept = run(n + 1, compile=False)  # the user's word stands, however long the run
    assert not cfg.parallel.compile and (kept is None or "compile" not in kept)
    cfg, alone = run(n + 1, dp_replicate=2, dp_shard=1)  # no layout choice: the decision alone
    assert cfg.parallel.compile and set(alone) == {"compile"}


def test_the_compile_decision_is_logged(parity_base, tmp_path):
    """`ndtrain train`'s start-up: the decision and its sums go to the log and metrics.jsonl
    (a compile time no run repays: off, and nothing compiles)."""
    from ndtrain.train.trainer import train

    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(steps=2, output_dir=str(tmp_path / "run"))
    base["parallel"] = {"auto_hardware": calibrated_profile(tmp_path, compile_s=1e9)}
    cfg = load_config(None, base)
    train(cfg, plan=apply_auto_layout)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    event = next(r for r in rows if r.get("event") == "compile_auto")
    assert event["compile"] is False and event["compile_s"] == 1e9 and event["breakeven_steps"] > 2
    assert not cfg.parallel.compile


@pytest.mark.slow
def test_a_run_long_enough_compiles_and_trains_as_eager(parity_base, tmp_path):
    """A compile time the run repays: on, the blocks compile (dynamo traced graphs) and the loss
    matches the eager run's (fp32, the parity tolerance)."""
    import torch

    from ndtrain.train.trainer import train

    def run(name, compile_s):
        base = {k: dict(v) for k, v in parity_base.items()}
        base["train"].update(steps=3, output_dir=str(tmp_path / name))
        base["parallel"] = {"auto_hardware": calibrated_profile(tmp_path, name, compile_s=compile_s)}
        cfg = load_config(None, base)
        train(cfg, plan=apply_auto_layout)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return cfg, [r["loss"] for r in rows if "loss" in r]

    torch._dynamo.reset()
    cfg, compiled = run("compiled", 1e-6)
    assert cfg.parallel.compile and torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    cfg, eager = run("eager", 1e9)
    assert not cfg.parallel.compile
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)  # fp32: inductor reorders sums, 1e-5 as parity_base


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


def test_an_unknown_gpu_keeps_the_static_default(monkeypatch):
    """`auto = true` on a GPU the planner's catalog lacks is an error the user asked for; the
    defaults' choice there falls back to the static default instead of stopping the run."""
    import torch

    from ndtrain.errors import NdtrainError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Imaginary GPU 9000")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: type("P", (), {"total_memory": 2**34})())
    cfg = load_config(None, {**PEERS, "train": {**PEERS["train"], "device": "cuda"}})
    assert apply_auto_layout(cfg, 2) is None and cfg.parallel.dp_shard == -1
    cfg = load_config(None, {**PEERS, "train": {**PEERS["train"], "device": "cuda"}, "parallel": {"auto": True}})
    with pytest.raises(NdtrainError, match="not in the planner's catalog"):
        apply_auto_layout(cfg, 2)
