"""Config loading, overrides and validation: every error names its key."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ndtrain.config import from_dict, load_config, parse_overrides, to_dict, to_toml
from ndtrain.errors import ConfigError, NdtrainError


def test_defaults_and_round_trip(tmp_path):
    cfg = load_config("configs/debug.toml", ["--train.steps=7", "--model.dim", "128", "--checkpoint.async=true"])
    assert cfg.name == "debug"
    assert cfg.train.steps == 7 and cfg.model.dim == 128 and cfg.checkpoint.async_ is True
    assert cfg.model.n_layers == 4  # from the preset
    again = from_dict(to_dict(cfg))
    assert to_toml(again) == to_toml(cfg)
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert to_toml(load_config(str(path))) == to_toml(cfg)


def test_preset_then_overrides():
    cfg = load_config(None, {"model": {"preset": "llama3-8b", "n_layers": 2}})
    assert cfg.model.dim == 4096 and cfg.model.n_layers == 2 and cfg.model.preset == "llama3-8b"


def test_float_accepts_int_and_list_types():
    cfg = load_config(None, ["--optimizer.lr=1", "--optimizer.betas=[0.8, 0.9]"])
    assert cfg.optimizer.lr == 1.0 and cfg.optimizer.betas == [0.8, 0.9]


BAD = [
    # (overrides, key the message must name)
    (["--model.dimx=3"], "model.dimx"),
    (["--nosection.key=1"], "nosection.key"),
    (["--train.steps=abc"], "train.steps"),
    (["--train.steps=1.5"], "train.steps"),
    (["--parallel.sequence_parallel=1"], "parallel.sequence_parallel"),
    (["--optimizer.betas=0.9"], "optimizer.betas"),
    (["--model.preset=gpt5"], "model.preset"),
    (["--model.dim=0"], "model.dim"),
    (["--model.n_heads=7"], "model.n_heads"),
    (["--model.n_kv_heads=3"], "model.n_kv_heads"),
    (["--model.mlp=relu"], "model.mlp"),
    (["--data.tokenizer=wordpiece"], "data.tokenizer"),
    (["--data.seq_len=0"], "data.seq_len"),
    (["--data.seq_len=4096"], "data.seq_len"),
    (["--data.max_mb=0"], "data.max_mb"),
    (["--optimizer.lr=0"], "optimizer.lr"),
    (["--optimizer.min_lr_ratio=2"], "optimizer.min_lr_ratio"),
    (["--optimizer.warmup_steps=-1"], "optimizer.warmup_steps"),
    (["--optimizer.schedule=linear"], "optimizer.schedule"),
    (["--optimizer.betas=[0.9, 1.5]"], "optimizer.betas"),
    (["--optimizer.eps=0"], "optimizer.eps"),
    (["--optimizer.weight_decay=-1"], "optimizer.weight_decay"),
    (["--optimizer.grad_clip=-1"], "optimizer.grad_clip"),
    (["--optimizer.implementation=magic"], "optimizer.implementation"),
    (["--train.steps=0"], "train.steps"),
    (["--train.global_batch=0"], "train.global_batch"),
    (["--train.micro_batch=0"], "train.micro_batch"),
    (["--train.device=tpu"], "train.device"),
    (["--train.backend=mpi"], "train.backend"),
    (["--train.val_interval=-1"], "train.val_interval"),
    (["--train.val_batches=-1"], "train.val_batches"),
    (["--train.log_interval=0"], "train.log_interval"),
    (["--train.timeout_s=0"], "train.timeout_s"),
    (["--train.batch_ramp=[[0]]"], "train.batch_ramp"),
    (["--parallel.zero=4"], "parallel.zero"),
    (["--parallel.zero=2"], "parallel.zero"),  # changed meaning: must say which one (docs/layouts.md, The ZeRO stage)
    (["--parallel.zero=1", "--parallel.reshard_after_forward=true"], "parallel.reshard_after_forward"),
    (["--parallel.pp_schedule=Bogus"], "parallel.pp_schedule"),  # checked even with pp = 1
    (["--parallel.tp=3"], "parallel.tp"),  # no world needed to know 8 heads do not split 3 ways
    (["--parallel.cp=3", "--data.seq_len=64"], "data.seq_len"),
    (["--parallel.pp=8"], "parallel.pp"),  # 4 layers cannot make 8 stages, whatever the world
    (["--parallel.mixed_precision=fp4"], "parallel.mixed_precision"),
    (["--parallel.fp8_recipe=blockwise"], "parallel.fp8_recipe"),
    (["--parallel.activation_checkpoint=some"], "parallel.activation_checkpoint"),
    (["--parallel.ac_every=0"], "parallel.ac_every"),
    (["--parallel.cp_attention=flash"], "parallel.cp_attention"),
    (["--parallel.cpu_matmul=mkl"], "parallel.cpu_matmul"),
    (["--parallel.compile_auto=sometimes"], "parallel.compile_auto"),
    (["--parallel.pp_virtual_stages=0"], "parallel.pp_virtual_stages"),
    (["--parallel.pp_microbatches=-1"], "parallel.pp_microbatches"),
    (["--parallel.tp=0"], "parallel.tp"),
    (["--parallel.dp_replicate=-2"], "parallel.dp_replicate"),
    (["--parallel.tp=-1"], "parallel"),  # dp_shard is -1 already: two free degrees
    (["--checkpoint.interval_steps=-1"], "checkpoint.interval_steps"),
    (["--checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (["--checkpoint.keep_every=-1"], "checkpoint.keep_every"),
    (["--logging.progress=maybe"], "logging.progress"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[k for _, k in BAD])
def test_every_config_error_names_its_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key
    assert f"'{key}'" in str(err.value)


def test_override_syntax_errors():
    with pytest.raises(NdtrainError):
        parse_overrides(["steps=3"])
    with pytest.raises(ConfigError):
        parse_overrides(["--train.steps"])
    with pytest.raises(NdtrainError, match="not found"):
        load_config("configs/nope.toml")


def test_cli_reports_one_line_and_exit_code_2(hang_deadline):
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "config", "show", "--train.steps=x"],
                          capture_output=True, text=True, timeout=hang_deadline(60))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "train.steps" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "ndtrain", "config", "show", "--config", "configs/default.toml"],
                        capture_output=True, text=True, timeout=hang_deadline(60))
    assert ok.returncode == 0 and 'preset = "tiny"' in ok.stdout


# ---- [parallel] is the layout's field list (ndtrain.layout.degrees) -------------------------

FIXTURES = Path(__file__).parent / "fixtures"


def test_a_config_toml_written_by_main_before_the_one_schema_still_loads():
    # Written by commit 1232899's to_toml (hand-written TOML, its own key order): a run
    # directory's config.toml and a checkpoint's stored config of that day.
    path = FIXTURES / "config-written-by-1232899.toml"
    for cfg in (load_config(str(path)), from_dict(tomllib.loads(path.read_text()))):
        p = cfg.parallel
        assert (p.zero, p.reshard_after_forward, p.tp, p.sequence_parallel) == (1, False, 2, False)
        assert (p.pp_schedule, p.activation_checkpoint, p.mixed_precision) == ("Interleaved1F1B", "selective", "bf16")
        assert (p.dp_auto, p.mixed_precision_auto, p.compile_auto) == (False, False, True)
        assert cfg.train.batch_ramp == [[0, 8], [1000, 16]] and cfg.checkpoint.async_ is True
        assert cfg.data.mix == [["web", 0.7], ["code", 0.3]] and cfg.optimizer.lr == 1.0
        assert to_dict(load_config(None, tomllib.loads(to_toml(cfg)))) == to_dict(cfg)  # tomli_w writes it back


def test_every_layout_key_of_parallel_is_a_config_key_with_the_configs_default():
    from ndtrain.config import ParallelConfig
    from ndtrain.layout import Layout, from_config
    from ndtrain.layout.degrees import SECTION

    par = ParallelConfig()
    for name, section in SECTION.items():
        if section == "parallel":
            assert hasattr(par, name), name
    # The config's layout is a bare Layout but for dp_shard (the rest of the world) and the micro-batch.
    cfg = load_config(None, {})
    assert from_config(cfg.parallel, cfg.train, cfg.data) == Layout(dp_shard=-1, micro_batch=cfg.train.micro_batch)


@pytest.mark.parametrize("override,message", [
    ("--parallel.pp_split=zigzag", "must be one of balanced, uniform, llama3, got 'zigzag'"),
    ("--parallel.replicate_sync=gossip", "must be one of step, diloco, got 'gossip'"),
    ("--parallel.diloco_outer_dtype=fp16", "must be one of fp32, bf16, got 'fp16'"),
    ("--parallel.tp=true", "must be an integer, got True"),
    ("--parallel.layers_per_stage=[2, 2.5]", "must be an integer, got 2.5"),
    ("--parallel.cpu_offload=1", "must be true or false, got 1"),
    ("--optimizer.betas=[0.9, nan]", "must be a finite number, got nan"),
    ("--parallel.auto_hardware=[1]", "must be a string, got [1]"),
])
def test_type_and_vocabulary_errors_are_one_line_naming_the_key(override, message):
    """The same words as the corpus manifest's errors (errors.pydantic_problem); a list's item is
    named by its index."""
    key = override[2:].split("=")[0]
    if override.endswith("]") and not override.endswith("=[1]"):
        key += "[1]"
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key and str(err.value) == f"config key '{key}': {message}"


def test_reshard_after_forward_follows_the_stage_unless_given():
    # One meaning, in the config and the text syntax alike (layout/degrees.py reshard_default):
    # not given, it is true at zero = 3 and false at 1 and 2; given true below 3, it is refused.
    from ndtrain.layout import parse_layout

    assert load_config(None, ["--parallel.zero=1"]).parallel.reshard_after_forward is False
    assert load_config(None, ["--parallel.zero=2", "--parallel.reshard_after_forward=false"]).parallel.zero == 2
    assert load_config(None, ["--parallel.zero=3"]).parallel.reshard_after_forward is True
    assert parse_layout("zero=1").reshard_after_forward is False and parse_layout("zero=3").reshard_after_forward
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--parallel.zero=1", "--parallel.reshard_after_forward=true"])
    assert err.value.key == "parallel.reshard_after_forward"
    from ndtrain.layout import problems
    from ndtrain.model.config import preset

    found = problems(parse_layout("dp_shard=2,zero=2,reshard_after_forward=1", 2), preset("debug"), 2)
    assert found and found[0].key == "parallel.reshard_after_forward"


def test_the_planner_choices_turn_off_where_their_key_is_given():
    given = load_config(None, ["--parallel.compile=true", "--parallel.cpu_matmul=blas", "--parallel.zero=3"]).parallel
    assert (given.compile_auto, given.cpu_matmul_auto, given.dp_auto, given.mixed_precision_auto) == \
        (False, False, False, True)
    both = load_config(None, ["--parallel.compile=true", "--parallel.compile_auto=true"]).parallel
    assert both.compile_auto is True
