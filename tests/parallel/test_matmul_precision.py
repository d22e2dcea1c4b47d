"""`[parallel] fp32_matmul_precision`: TF32 tensor cores for fp32 matmuls on CUDA by default (as
Megatron-LM and torchtitan run), IEEE when asked; CPU ranks untouched (torch's CPU has no TF32).

No GPU here: the CUDA side is checked by what `parallelize` would set, through a stand-in for
torch's cuBLAS flag object on a process that claims CUDA."""

from __future__ import annotations

import pytest
import torch

from ndtrain import cli
from ndtrain.config import load_config
from ndtrain.errors import ConfigError
from ndtrain.layout import Layout, from_config, parse_layout
from ndtrain.model.config import ModelConfig
from ndtrain.model.llama import build_model
from ndtrain.parallel.compose import parallelize

pytestmark = pytest.mark.timeout(120)


class _CublasFlags:
    """Records what is written to torch.backends.cuda.matmul's fp32_precision."""

    def __init__(self):
        self.fp32_precision = "none"  # torch 2.13's value before anyone sets it


@pytest.fixture
def on_cuda(monkeypatch):
    flags = _CublasFlags()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "matmul", flags)
    return flags


@pytest.mark.parametrize("setting", ["tf32", "ieee"])
def test_parallelize_sets_cublas_fp32_precision_on_cuda(on_cuda, setting):
    parallelize(build_model(ModelConfig(), "meta"), Layout(fp32_matmul_precision=setting))
    assert on_cuda.fp32_precision == setting


def test_the_default_is_tf32_on_cuda(on_cuda):
    lay = from_config(load_config(None, {}).parallel)
    assert lay.fp32_matmul_precision == "tf32"
    parallelize(build_model(ModelConfig(), "meta"), lay)
    assert on_cuda.fp32_precision == "tf32"


def test_cpu_runs_leave_torch_flags_as_they_were():
    """On a process without CUDA nothing is set: not cuBLAS's flag (whose tf32 value makes torch
    2.13's legacy getters raise, inductor's autotuner among their callers) and not oneDNN's, which
    `torch.set_float32_matmul_precision` would turn to tf32 as well."""
    assert not torch.cuda.is_available()
    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
              torch.backends.fp32_precision, torch.get_float32_matmul_precision())
    x, w = torch.randn(64, 96), torch.randn(80, 96)
    ref = x @ w.t()
    for setting in ("tf32", "ieee"):
        parallelize(build_model(ModelConfig(), "meta"), Layout(fp32_matmul_precision=setting))
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision,
                torch.backends.fp32_precision, torch.get_float32_matmul_precision()) == before
        assert torch.equal(x @ w.t(), ref)  # the same kernel, bit for bit


def test_config_key_reaches_the_layout_and_bad_values_name_it():
    cfg = load_config(None, {"parallel": {"fp32_matmul_precision": "ieee"}})
    assert from_config(cfg.parallel).fp32_matmul_precision == "ieee"
    assert parse_layout("tp=1,fp32_matmul_precision=IEEE", 1).fp32_matmul_precision == "ieee"  # as cpu_matmul
    with pytest.raises(ConfigError, match=r"parallel\.fp32_matmul_precision.*tf32, ieee.*'fp16'"):
        load_config(None, {"parallel": {"fp32_matmul_precision": "fp16"}})


def test_config_show_prints_the_key_and_refuses_a_bad_value_in_one_line(capsys):
    assert cli.main(["config", "show"]) == 0
    assert 'fp32_matmul_precision = "tf32"' in capsys.readouterr().out
    assert cli.main(["config", "show", "--parallel.fp32_matmul_precision=high"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.fp32_matmul_precision" in err[0] and "Traceback" not in err[0]
