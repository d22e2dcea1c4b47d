"""The measurements the CPU and the GPU calibration share (calibrate/measure.py): the count
of calls a timing makes, and causal attention's rows, on every device this host has (the CUDA
case runs where a GPU is; the collectives run in tests/planner/test_command.py's calibration)."""

from __future__ import annotations

import pytest
import torch

from ndtrain.calibrate import gpu as calibrate_gpu
from ndtrain.calibrate.cpu import attention_rates
from ndtrain.calibrate.measure import measure_attention, seconds_per_call

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_timing_makes_its_warm_up_and_repetitions(device):
    calls = []
    x = torch.ones(64, 64, device=device)
    seconds = seconds_per_call(lambda: calls.append(x @ x), device, reps=4, warmup=2)
    assert len(calls) == 6 and seconds > 0


@pytest.mark.parametrize("device", DEVICES)
def test_attention_rows_name_the_shape_each_timed(device):
    rows = measure_attention(device, "bf16" if device == "cuda" else "fp32", (64, 128), heads=2, head_dim=16,
                             tokens=256, reps=2)
    assert [row[:4] for row in rows] == [[4, 2, 64, 16], [2, 2, 128, 16]]
    assert all(row[4] > 0 for row in rows)


def test_both_calibrations_use_the_one_definition():
    rates = attention_rates("fp32", (64,), min_time=0.0)
    assert list(rates) == ["64"] and rates["64"] > 0
    assert calibrate_gpu.measure_attention is measure_attention
    assert not hasattr(calibrate_gpu, "_collective_worker") and not hasattr(calibrate_gpu, "_time_cuda")
