"""The MFU peak on CPU: the host probe keeps the best of several runs of its Linear rates (a busy
moment of a shared host lowers some runs, not all), and a step that still runs above a measured
peak raises it to what the step did, said once. No timing: the measurements are replaced by
given rates, and the calls are counted."""

from __future__ import annotations

import json

import pytest
import torch

from ndtrain.planner import host_cache
from ndtrain.calibrate import host_probe
from ndtrain.train import metrics
from ndtrain.train.metrics import Peaks, metrics_row
from ndtrain.train.step import StepResult

AVX2 = host_cache.host_key("model name\t: old\nflags\t\t: fpu avx2\n", "2.13.0+cpu", env={}, cores=2)
BF16 = host_cache.host_key("model name\t: new\nflags\t\t: fpu avx2 avx512f avx512_bf16\n", "2.13.0+cpu", env={},
                           cores=2)


@pytest.fixture
def fake_probe(monkeypatch):
    """measure() with every measurement replaced: the Linear runs return the given rates in turn
    and every call is counted."""
    calls = {"linear": 0, "bf16": 0, "block_rounds": []}

    def run(key, linear: list[tuple[float, float]], bf16: list[float]):
        monkeypatch.setattr(host_cache, "host_key", lambda: key)

        def linear_rates():
            calls["linear"] += 1
            return linear[calls["linear"] - 1]

        def bf16_rate():
            calls["bf16"] += 1
            return bf16[calls["bf16"] - 1]

        monkeypatch.setattr(host_probe, "_linear_rates", linear_rates)
        monkeypatch.setattr(host_probe, "_bf16_linear_rate", bf16_rate)
        monkeypatch.setattr(host_probe, "_small_rates", lambda: (100e9, 20e9))
        monkeypatch.setattr(host_probe, "_attention_rates", lambda d: (15e9, 12e9, 16e9))
        monkeypatch.setattr(host_probe, "_block_speedup",
                            lambda kernel, attend_in, rounds=6: calls["block_rounds"].append(rounds) or 1.5)
        return host_probe.measure()
    return run, calls


def test_the_peak_is_the_best_of_several_runs(fake_probe):
    run, calls = fake_probe
    # the second run caught the BLAS on a quiet moment, the third oneDNN: each keeps its best
    probe = run(AVX2, [(30e9, 40e9), (80e9, 35e9), (50e9, 60e9)], [2e9])
    assert calls["linear"] == host_probe.PEAK_RUNS == probe["peak_runs"] == 3
    r = probe["rates"]
    assert (r["fp32_blas"], r["fp32_onednn"]) == (80e9, 60e9)
    assert probe["decisions"]["cpu_matmul"] == "blas" and r["fp32"] == 80e9  # the peak MFU divides by
    # no bf16 dot products: its ~1 s bf16 Linear and its bf16 block are measured once
    assert calls["bf16"] == 1 and r["bf16"] == 2e9 and calls["block_rounds"] == [1]


def test_bf16_is_best_of_the_runs_where_the_cpu_has_bf16_dot_products(fake_probe):
    run, calls = fake_probe
    probe = run(BF16, [(60e9, 70e9)] * 3, [150e9, 90e9, 160e9])
    assert calls["bf16"] == 3 and probe["rates"]["bf16"] == 160e9 and calls["block_rounds"] == [6]


def test_best_rates_keeps_each_rates_highest():
    runs = [{"a": 1.0, "b": 5.0}, {"a": 3.0}, {"a": 2.0, "b": 4.0}]
    assert host_probe.best_rates(runs) == {"a": 3.0, "b": 5.0}


def test_an_older_probe_file_is_measured_again(tmp_path):
    """The peak's measurement changed: a file of the previous probe version is not this host's."""
    key = {**AVX2, "version": host_cache.PROBE_VERSION - 1}
    rates = {k: 1e9 for k in host_cache.REQUIRED_RATES}
    host_cache.write({"key": key, "rates": rates, "decisions": {}}, tmp_path)
    assert host_cache.cached_probe(tmp_path, key) is not None  # readable under its own key ...
    assert host_cache.cached_probe(tmp_path, AVX2) is None  # ... but not this version's


def peaks(total=100e9, source="measured", fp8=False) -> Peaks:
    return Peaks(total=total, source=source, fp8_total=total if fp8 else 0.0, fp8_source="", flops_per_token=1e6,
                 fp8=fp8)


def row_at(p: Peaks, step: int, gflops: float) -> dict:
    """The metrics row of a step that ran at `gflops` model GFLOP/s (1 MFLOP per token)."""
    tokens = 1000
    return metrics_row(StepResult(step, 2.0, 1.0, 1e-3, tokens, tokens * p.flops_per_token / (gflops * 1e9)), p,
                       step * tokens, torch.device("cpu"))


def test_a_step_above_the_measured_peak_raises_it_and_says_so_once(tmp_path, capsys):
    p = peaks()
    rows = [row_at(p, 1, 50), row_at(p, 2, 150), row_at(p, 3, 200), row_at(p, 4, 100)]
    assert [r["mfu"] for r in rows] == pytest.approx([0.5, 1.0, 1.0, 0.5])  # never "n/a": the peak rose
    assert p.total == pytest.approx(200e9) and p.raised
    noted = [r for r in rows if "peak_raised" in r]
    assert [r["step"] for r in noted] == [2]  # the first raise is said; the second is quiet
    assert "150.0 GFLOP/s" in noted[0]["peak_raised"] and "100.0" in noted[0]["peak_raised"]
    log = metrics.MetricsLogger(tmp_path / "run", True, 4, "off")
    for r in rows:
        log.last_print = 0.0  # print every row
        log.log(r)
    log.close()
    out = capsys.readouterr().out
    assert out.count("MFU peak raised") == 1 and "peak is wrong" not in out
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written if "peak_raised" in r] == [2]  # the run's record says when


def test_an_fp8_peak_follows_and_a_datasheet_peak_is_never_raised():
    p = peaks(fp8=True)
    row = row_at(p, 1, 300)
    assert p.total == p.fp8_total == pytest.approx(300e9) and row["mfu"] == row["mfu_fp8"] == pytest.approx(1.0)
    catalog = peaks(source="catalog H100 SXM")
    row = row_at(catalog, 1, 300)  # above a datasheet: the device or the FLOP count is wrong
    assert row["mfu"] is None and catalog.total == 100e9 and "peak_raised" not in row
