"""`[parallel] auto`: the planner's choice is a layout the runtime accepts for that world size."""

from __future__ import annotations

import json

import pytest

from ndtrain.config import load_config
from ndtrain.parallel.dims import checked_layout
from ndtrain.train.plan import as_written, resolve_plan
from ndtrain.train.plan_choices import DP_FIELDS


def test_auto_off_changes_nothing():
    cfg = load_config(None, {"parallel": {"tp": 2, "dp_auto": False}})
    plan = resolve_plan(cfg, 4)
    assert plan.prediction is None and plan.layout.tp == 2 and plan.layout.dp_shard == 2
    assert plan.layout == as_written(plan.config, 4).layout and cfg.parallel.dp_shard == -1  # the caller's config stays


PEERS = {"model": {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048},
         "data": {"seq_len": 256}, "train": {"global_batch": 8, "micro_batch": 4}}


@pytest.mark.parametrize("precision,chosen", [("fp32", "ddp"), pytest.param("bf16", "zero1", marks=pytest.mark.heavy)])
def test_defaults_choose_what_was_fastest(precision, chosen, tmp_path, monkeypatch):
    """No data-parallel key: the planner picks the flavour. For the peers' model at world 2 on CPU
    ranks it picks what trained fastest there (docs/results/history.md, run I), with the uncalibrated
    profile: DDP in fp32 (torch's DDP reducer overlaps its all-reduce with the backward), ZeRO-1
    in bf16 (replication runs on FSDP2's blocking all-reduce there, ZeRO-1's reduce-scatter is an
    all-to-all and its all-gather prefetched); every other knob stays as configured."""
    import ndtrain.planner.hardware as hardware

    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "none.json")  # no calibration here
    cfg = load_config(None, {**PEERS, "parallel": {"mixed_precision": precision}})
    assert cfg.parallel.dp_auto
    plan = resolve_plan(cfg, 2)
    lay = plan.layout
    got = "ddp" if (lay.dp_replicate, lay.dp_shard) == (2, 1) else \
        f"zero{lay.zero}" if (lay.dp_replicate, lay.dp_shard) == (1, 2) else str((lay.dp_replicate, lay.dp_shard))
    assert got == chosen, plan.explanation
    assert lay.micro_batch == 4 and lay.tp == 1 and lay.pp == 1
    assert plan.explanation.startswith("data parallel (defaults)")
    assert cfg.parallel.dp_shard == -1 and cfg.parallel.zero == 3  # chosen in the plan's config, not the caller's


def test_defaults_choose_by_memory_on_a_large_model():
    """Llama 3 8B on 8 H100s, seq 4096: without recompute only ZeRO-3 fits; with full recompute
    ZeRO-1 and ZeRO-2 fit and, gathering once per step instead of twice, are faster. The two move
    the same bytes (a reduce-scatter of the gradients, one all-gather of the parameters), so the
    planner prices them at the same step time and either may win."""
    def choose(ac):
        cfg = load_config(None, {"model": {"preset": "llama3-8b"}, "data": {"seq_len": 4096},
                                 "parallel": {"auto_hardware": "h100", "activation_checkpoint": ac},
                                 "train": {"global_batch": 8, "micro_batch": 1}})
        lay = resolve_plan(cfg, 8).layout
        return lay.dp_replicate, lay.dp_shard, lay.zero

    assert choose("none") == (1, 8, 3)
    replicate, shard, zero = choose("full")
    assert (replicate, shard) == (1, 8) and zero in (1, 2)


@pytest.mark.parametrize("given", [{"dp_shard": 2}, {"zero": 1}, {"dp_replicate": 2, "dp_shard": 1},
                                   {"reshard_after_forward": False}, {"dp_auto": False}])
def test_a_data_parallel_key_keeps_the_users_choice(given):
    cfg = load_config(None, {**PEERS, "parallel": dict(given)})
    assert not cfg.parallel.dp_auto
    static = as_written(cfg, 2).layout
    plan = resolve_plan(cfg, 2)
    assert plan.prediction is None and not {key for _, key, _ in plan.chosen} & set(DP_FIELDS)
    assert [getattr(plan.layout, k) for k in DP_FIELDS] == [getattr(static, k) for k in DP_FIELDS]


def test_dp_choice_survives_a_stored_config():
    from ndtrain.config import from_dict, to_dict

    again = from_dict(to_dict(resolve_plan(load_config(None, PEERS), 2).config))
    assert again.parallel.dp_auto and (again.parallel.dp_replicate, again.parallel.dp_shard) == (2, 1)


@pytest.mark.heavy
def test_no_choice_where_the_planner_cannot_price_it(tmp_path, monkeypatch):
    import ndtrain.planner.hardware as hardware

    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "none.json")  # uncalibrated: compile unpriced
    for parallel in ({"pp": 2, "pp_microbatches": 2}, {"activation_checkpoint": "every_n"}):
        cfg = load_config(None, {**PEERS, "parallel": parallel})
        plan = resolve_plan(cfg, 4)
        assert plan.prediction is None and plan.compile is None, parallel
        assert plan.layout.dp_shard == 4 // plan.layout.pp and plan.layout.zero == 3, parallel
    assert resolve_plan(load_config(None, PEERS), 1).prediction is None


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
        return cfg, resolve_plan(cfg, 2)

    _, short = run(35)
    assert not short.layout.compile and not short.compile.compile
    assert short.explanation.startswith("data parallel (defaults)")  # the layout was chosen too
    n = short.compile.breakeven_steps
    cfg, long = run(n + 1)
    assert long.layout.compile and long.config.parallel.compile and "torch.compile on" in long.compile.description
    assert not cfg.parallel.compile  # decided in the plan, not in the caller's config
    assert long.prediction.step_s == long.compile.compiled_step_s < short.prediction.step_s
    _, kept = run(n + 1, compile=False)  # the user's word stands, however long the run
    assert not kept.layout.compile and kept.compile is None
    _, alone = run(n + 1, dp_replicate=2, dp_shard=1)  # no layout choice: the decision alone
    assert alone.layout.compile and alone.compile.compile and alone.prediction is None


def test_the_compile_decision_is_logged(parity_base, tmp_path):
    """`ndtrain train`'s start-up: the decision and its sums go to the log and metrics.jsonl
    (a compile time no run repays: off, and nothing compiles)."""
    from ndtrain.train.trainer import train

    base = {k: dict(v) for k, v in parity_base.items()}
    base["train"].update(steps=2, output_dir=str(tmp_path / "run"))
    base["parallel"] = {"auto_hardware": calibrated_profile(tmp_path, compile_s=1e9)}
    cfg = load_config(None, base)
    train(cfg)  # the Python API resolves the plan as `ndtrain train` does
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    event = next(r for r in rows if r.get("event") == "compile_auto")
    assert event["compile"] is False and event["compile_s"] == 1e9 and event["breakeven_steps"] > 2
    assert not cfg.parallel.compile
    # the resolved plan, in the run directory and in the attempt's first row of metrics.jsonl
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["compile"]["compile"] is False and plan["layout"]["compile"] is False and plan["world"] == 1
    assert next(r for r in rows if r.get("event") == "start")["plan"] == plan


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
        train(load_config(None, base))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        compiled = json.loads((tmp_path / name / "plan.json").read_text())["layout"]["compile"]
        return compiled, [r["loss"] for r in rows if "loss" in r]

    torch._dynamo.reset()
    on, compiled = run("compiled", 1e-6)
    assert on and torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    on, eager = run("eager", 1e9)
    assert not on
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)  # fp32: inductor reorders sums, 1e-5 as parity_base


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_auto_layout_is_buildable(world):
    cfg = load_config(None, {"parallel": {"auto": True}, "train": {"global_batch": 16, "micro_batch": 4},
                             "data": {"seq_len": 128}})
    plan = resolve_plan(cfg, world)
    dims = checked_layout(plan.config.parallel, world, cfg.model, cfg.data.seq_len, plan.config.train)
    assert dims == plan.layout and dims.world == world
    assert cfg.train.global_batch % (dims.dp * dims.micro_batch) == 0
    assert plan.prediction.step_s > 0 and "predicted" in plan.explanation


def test_the_whole_choice_reaches_the_runtime():
    """Degrees, ZeRO stage, schedule, v, pipeline micro-batches, stage split, recompute and the
    micro-batch: the config after auto is exactly the planner's layout."""
    from ndtrain.layout import from_config

    cfg = load_config(None, {"model": {"preset": "llama3-8b"}, "data": {"seq_len": 8192},
                             "parallel": {"auto": True, "auto_hardware": "h100"},
                             "train": {"global_batch": 64, "micro_batch": 1}})
    from ndtrain.train.plan_choices import layout_choice

    lay = layout_choice(cfg, 64)["layout"]  # the planner's own choice
    plan = resolve_plan(cfg, 64)
    assert from_config(plan.config.parallel, plan.config.train) == lay
    if lay.pp > 1:
        assert sum(plan.config.parallel.layers_per_stage) == 32 and plan.config.parallel.pp_microbatches == lay.pp_microbatches > 0
    assert plan.layout == lay and plan.prediction.hardware == "h100"


def test_auto_plans_for_the_gpu_it_finds(monkeypatch):
    import torch

    from ndtrain.errors import NdtrainError
    from ndtrain.train.plan_choices import auto_hardware
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
    """A Trainer built without a plan trains the config as written: `auto` there gets one line, not a guess."""
    from ndtrain.errors import ConfigError

    cfg = load_config(None, {"parallel": {"auto": True}})
    with pytest.raises(ConfigError, match="parallel.auto"):
        as_written(cfg, 2)
    assert as_written(load_config(None, {}), 2).prediction is None
    plan = resolve_plan(cfg, 2)
    assert plan.explanation.startswith(plan.layout.short()) and plan.prediction is not None


def test_an_unknown_gpu_keeps_the_static_default(monkeypatch):
    """`auto = true` on a GPU the planner's catalog lacks is an error the user asked for; the
    defaults' choice there falls back to the static default instead of stopping the run."""
    import torch

    from ndtrain.errors import NdtrainError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Imaginary GPU 9000")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: type("P", (), {"total_memory": 2**34})())
    cfg = load_config(None, {**PEERS, "train": {**PEERS["train"], "device": "cuda"}})
    plan = resolve_plan(cfg, 2)
    assert plan.prediction is None and plan.layout.dp_shard == 2 and plan.layout.zero == 3
    cfg = load_config(None, {**PEERS, "train": {**PEERS["train"], "device": "cuda"}, "parallel": {"auto": True}})
    with pytest.raises(NdtrainError, match="not in the planner's catalog"):
        resolve_plan(cfg, 2)


# ---- one resolution: `ndtrain train` and the Python API build the same plan -----------------

PEERS_ARGS = ["--model.dim=256", "--model.n_layers=6", "--model.n_heads=16", "--model.n_kv_heads=16",
              "--model.ffn_dim=768", "--model.vocab_size=2048", "--data.seq_len=256", "--train.global_batch=8",
              "--train.micro_batch=4"]


class _Resolved(Exception):
    """Stops train() right after it resolved its plan: nothing is built or trained."""


@pytest.mark.parametrize("case", ["defaults", "dp_auto", "compile_auto", "auto"])
def test_the_command_and_the_python_api_resolve_the_same_plan(case, tmp_path, monkeypatch):
    """`ndtrain train` and `ndtrain.train.trainer.train(cfg)` resolve one Plan for one config (they
    used to differ: only the command handed the planner down, so the Python API kept the static
    ZeRO-3 where the command chose DDP); the caller's config is left as it was."""
    import copy

    from ndtrain import cli
    from ndtrain.train import job, trainer

    args, world = {
        "defaults": ([], 1),
        "dp_auto": (PEERS_ARGS, 2),
        "compile_auto": (PEERS_ARGS + ["--train.steps=1000000", f"--parallel.auto_hardware={calibrated_profile(tmp_path)}"], 2),
        "auto": (["--parallel.auto=true", "--train.global_batch=16", "--train.micro_batch=4", "--data.seq_len=128"], 4),
    }[case]
    args = args + ["--logging.tensorboard=false", f"--train.output_dir={tmp_path / 'run'}"]
    seen = []

    def resolve_and_stop(cfg, w, *a, **k):
        seen.append(resolve(cfg, w, *a, **k))
        raise _Resolved

    resolve = job.resolve_plan  # job.train resolves the plan, for the command and the API alike
    monkeypatch.setattr(job, "resolve_plan", resolve_and_stop)
    monkeypatch.setattr(job, "env_world_size", lambda: world)  # the world a launcher would give
    with pytest.raises(_Resolved):
        cli.main(["train", *args])
    cfg = load_config(None, args)
    before = copy.deepcopy(cfg)
    with pytest.raises(_Resolved):
        trainer.train(cfg)
    command, api = seen
    assert command == api and command.world == world
    assert cfg == before  # resolving changed a copy only
    if case == "defaults":  # on CPU ranks the host probe's choices reach both
        assert command.host is not None and command.prediction is None
    if case == "dp_auto":  # the Python API too: DDP, not the static ZeRO-3
        assert (command.layout.dp_replicate, command.layout.dp_shard) == (2, 1)
        assert ("parallel", "dp_replicate", 2) in command.chosen
    if case == "compile_auto":
        assert command.compile is not None and command.layout.compile == command.compile.compile
    if case == "auto":
        assert command.prediction is not None and command.explanation.startswith(command.layout.short())


def test_the_command_and_the_python_api_build_the_same_layout(corpus_dir, tmp_path, monkeypatch):
    """The layout each entry point checks and builds, seen where it is checked: a run long enough
    to repay compiling compiles from the command and from Python alike (the Python API used to
    keep compile off: only the command handed the planner down)."""
    from ndtrain import cli
    from ndtrain.parallel import dims
    from ndtrain.train.trainer import train

    built = []

    def check_and_stop(*args, **kwargs):
        built.append(real(*args, **kwargs))
        raise _Resolved

    real = dims.checked_layout
    monkeypatch.setattr(dims, "checked_layout", check_and_stop)
    args = [f"--data.path={corpus_dir}", "--train.steps=1000000", "--train.val_interval=0",
            "--logging.tensorboard=false", f"--parallel.auto_hardware={calibrated_profile(tmp_path)}"]
    with pytest.raises(_Resolved):
        cli.main(["train", *args, f"--train.output_dir={tmp_path / 'command'}"])
    with pytest.raises(_Resolved):
        train(load_config(None, [*args, f"--train.output_dir={tmp_path / 'api'}"]))
    command, api = built
    assert command.compile and command == api
