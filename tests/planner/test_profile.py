"""GPU calibration profiles: fitting the constants from measurements, writing the profile,
reading it in `plan --profile`, and the errors. No GPU here: the measurements are synthesized
from the planner's own model with known constants, so the fit must recover them."""

import json

import pytest

from ndtrain.cli import main as cli
from ndtrain.model.config import preset
from ndtrain.planner import profile, profile_fit
from ndtrain.calibrate.cpu import fit_alpha_beta
from ndtrain.planner.accelerator import GiB
from ndtrain.planner.hardware import CATALOG, COLLECTIVES
from ndtrain.planner.problem import make_problem
from ndtrain.calibrate import gpu as calibrate_gpu

H100 = CATALOG["h100"]
TRUE = {"gemm_eff": 0.70, "gemm_k0": 96.0, "fp8_gemm_eff": 0.55}


def synthetic() -> dict:
    """What calibrate_gpu would measure on an H100 whose constants are TRUE."""
    k = {**profile.consts.resolve("hopper"), **TRUE}
    gemm = []
    for m, n, kk in calibrate_gpu.GEMM_SHAPES:
        gemm.append([m, n, kk, "bf16", profile_fit._gemm_model(H100, k, m, n, kk, False)])
        gemm.append([m, n, kk, "fp8", profile_fit._gemm_model(H100, k, m, n, kk, True)])
    attention = []
    for s in (2048, 8192):
        b, h, d = 16384 // s, 32, 128
        attention.append([b, h, s, d, 6 * b * h * s * s * d * (1 + 128 / s) / (H100.peak_bf16 * 0.5)])
    colls = {kind: [[8, n, a * h + n * sh / 300e9] for n in (4096, 1 << 20, 1 << 26)
                    for a, (h, sh) in [(4e-6, {"p2p": (1, 1), "all_reduce": (14, 1.75)}.get(kind, (7, 0.875)))]]
             for kind in COLLECTIVES}
    return {"device_name": "NVIDIA H100 80GB HBM3", "gpus": 8, "calibrated": "2026-12-01", "gemm": gemm,
            "attention": attention, "hbm": {"copy_bw": 0.9 * H100.hbm_bw}, "collectives": colls,
            "memory": {"overhead_bytes": 2.5 * GiB, "fragmentation": 0.07}}


def test_build_recovers_the_constants_it_was_measured_with():
    prof = profile_fit.fit_profile(H100, synthetic(), fit_alpha_beta)
    c = prof["constants"]
    assert c["gemm_eff"] == pytest.approx(TRUE["gemm_eff"], abs=0.005)
    assert c["gemm_k0"] == TRUE["gemm_k0"]
    assert c["fp8_gemm_eff"] == pytest.approx(TRUE["fp8_gemm_eff"], abs=0.005)
    assert c["attn_eff"] == pytest.approx(0.5)
    assert c["hbm_eff"] == pytest.approx(0.9)
    assert c["overhead_gib"] == pytest.approx(2.5) and c["fragmentation"] == pytest.approx(0.07)
    for fit in prof["collectives"].values():
        assert fit["alpha"] == pytest.approx(4e-6, rel=0.05) and fit["beta"] == pytest.approx(300e9, rel=0.05)
    assert prof["kind"] == "gpu" and prof["catalog"] == "h100"


def test_plan_reads_the_profile(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(profile_fit.fit_profile(H100, synthetic(), fit_alpha_beta)))
    pb = make_problem(preset("llama3-8b"), 8192, 64, 8, "h100", profile=str(path))
    assert pb.k["gemm_eff"] == pytest.approx(0.70, abs=0.005) and pb.k["overhead_gib"] == pytest.approx(2.5)
    assert pb.hw.collectives["all_reduce"]["beta"] == pytest.approx(300e9, rel=0.05)
    default = make_problem(preset("llama3-8b"), 8192, 64, 8, "h100")
    assert pb.k["gemm_eff"] != default.k["gemm_eff"]
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--global-batch", "64",
                "--profile", str(path), "--top", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["robustness"]["constants"]["gemm_eff"] == pytest.approx(0.70, abs=0.005)


@pytest.mark.parametrize("case", ["cpu-profile", "wrong-gpu", "not-json", "version"])
def test_profile_errors_are_one_line(tmp_path, capsys, case):
    path = tmp_path / "p.json"
    good = profile_fit.fit_profile(H100, synthetic(), fit_alpha_beta)
    gpu = "h100"
    if case == "cpu-profile":
        path.write_text(json.dumps({"matmul": {"fp32_1thread": 1e10}}))
    elif case == "wrong-gpu":
        path.write_text(json.dumps(good))
        gpu = "a100-80"
    elif case == "not-json":
        path.write_text("{")
    else:
        path.write_text(json.dumps({**good, "version": 99}))
    before = path.read_text()
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", gpu, "--global-batch", "64",
                "--profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ndtrain plan: error:") and "\n" not in err and "profile" in err
    assert path.read_text() == before


def test_gpu_profile_is_not_a_cpu_profile(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(profile_fit.fit_profile(H100, synthetic(), fit_alpha_beta)))
    assert cli(["plan", "--model", "debug", "--gpus", "2", "--gpu", "this-machine", "--global-batch", "8",
                "--seq", "64", "--profile", str(path)]) == 2
    assert "--gpu h100" in capsys.readouterr().err


def test_calibrate_gpu_path_writes_what_plan_reads(tmp_path, monkeypatch, capsys):
    """The GPU branch of `ndtrain calibrate` end to end, with the measuring replaced (no GPU here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibrate_gpu, "calibrate_gpu", lambda quick: (H100, synthetic()))
    out = tmp_path / "gpu.json"
    assert cli(["calibrate", "--device", "gpu", "--out", str(out)]) == 0
    assert "--profile" in capsys.readouterr().out
    assert make_problem(preset("llama3-8b"), 8192, 64, 8, "h100", profile=str(out)).k["gemm_k0"] == 96.0


def test_calibrate_device_gpu_without_cuda_is_a_usage_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli(["calibrate", "--device", "gpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
