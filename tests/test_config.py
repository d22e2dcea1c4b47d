"""Config loading, overrides and validation: every error names its key."""

from __future__ import annotations

import subprocess
import sys

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


def test_cli_reports_one_line_and_exit_code_2():
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "config", "show", "--train.steps=x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "train.steps" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "ndtrain", "config", "show", "--config", "configs/default.toml"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and 'preset = "tiny"' in ok.stdout
