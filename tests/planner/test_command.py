"""The CLI: `ndtrain plan`, `ndtrain goodput`, `ndtrain calibrate`, and planning without torch."""

import json
import subprocess
import sys

import pytest

from ndtrain.cli import main as cli
from ndtrain.planner.hardware import this_machine


def test_plan_text_with_explain(capsys):
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "8192",
                "--global-batch-tokens", "1M", "--tokens", "15T", "--explain"]) == 0
    out = capsys.readouterr().out
    for word in ("#1", "MFU", "bubble", "exposed comm", "activations", "days", "MWh", "why the others lost"):
        assert word in out


def test_plan_json_and_single_layout(capsys):
    assert cli(["plan", "--model-shape", "layers=24,hidden=2304,heads=24,mlp=gelu,vocab=51200", "--gpus", "32",
                "--gpu", "a100-80", "--seq", "2048", "--global-batch", "512", "--json", "--relaxed",
                "--layout", "dp_replicate=32,micro_batch=4,activation_checkpoint=full"]) == 0
    out = json.loads(capsys.readouterr().out)
    lay = out["layouts"][0]
    for key in ("memory_gib", "time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "days", "energy_mwh"):
        assert key in lay
    assert lay["layout"]["dp_replicate"] == 32 and lay["hfu"] > lay["mfu"]
    assert set(lay["time_s"]) >= {"compute", "exposed_comm", "bubble", "total"}


def test_plan_user_errors_are_one_line(capsys):
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--layout", "tp=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ndtrain plan: error:") and "\n" not in err
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8"]) == 2
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--gpu", "tpu"]) == 2


def test_moe_plan_on_h800(capsys):
    assert cli(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "h800", "--seq", "4096",
                "--global-batch", "64", "--top", "1", "--precision", "fp8"]) == 0
    assert "ep=" in capsys.readouterr().out


def test_goodput_cli(capsys):
    assert cli(["goodput", "--gpus", "16384", "--mtbf-gpu-hours", "50000", "--ckpt-save", "1m",
                "--restart", "5m", "--days", "5", "--trials", "5"]) == 0
    out = capsys.readouterr().out
    assert "daly" in out and "young" in out and "simulated" in out
    assert cli(["goodput", "--gpus", "8", "--mtbf-gpu-hours", "1", "--ckpt-save", "soon", "--restart", "1m"]) == 2


def test_planner_never_imports_torch():
    code = ("import sys; from ndtrain.cli import main; "
            "main(['plan','--model','llama3-8b','--gpus','8','--global-batch','64','--top','1']); "
            "main(['goodput','--gpus','8','--mtbf-gpu-hours','1000','--ckpt-save','1m','--restart','1m','--trials','2','--days','1']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.heavy
def test_calibrate_writes_a_profile_the_catalog_loads(tmp_path, capsys):
    out = tmp_path / "hw.json"
    assert cli(["calibrate", "--quick", "--worlds", "2", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert set(prof["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    for fit in prof["collectives"].values():
        assert fit["alpha"] > 0 and fit["beta"] > 0
    hw = this_machine(out)
    assert hw.peak("fp32") == prof["matmul"]["fp32_1thread"] and hw.collectives["p2p"]["alpha"] > 0
    # the CPU-rank terms: cores, attention, host and optimizer costs, in-situ TP cost, per-world fits
    assert hw.cores >= 1 and hw.attention_rate("fp32", 256) == prof["attention"]["fp32"]["256"] > 0
    assert hw.layer_overhead_s > 0 and hw.optimizer_s_per_param > 0
    assert hw.tp_cost(2, 2, "layer", 1e5) > 0 and set(hw.collectives_by_world) == {"2"}


def test_this_machine_falls_back_to_defaults(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        this_machine(tmp_path / "missing.json")


def test_plan_intervals_robustness_network_and_stack(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100", "--seq", "8192", "--global-batch", "128"]
    assert cli(base + ["--network", "pod=32,oversub=4", "--stack", "megatron-core-2024", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "stack megatron-core-2024" in out and "over sampled constants" in out and "robustness:" in out
    assert "#1 " in out and ("overlap" in out or "nominal fastest" in out)
    assert cli(base + ["--samples", "0", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "robustness:" not in out and "over sampled constants" not in out
    assert cli(base + ["--json", "--top", "2"]) == 0
    js = json.loads(capsys.readouterr().out)
    lo, hi = js["layouts"][0]["step_time_interval_s"]
    assert lo <= js["layouts"][0]["step_time_s"] <= hi and 0 <= js["robustness"]["share_within_2pct"] <= 1


@pytest.mark.parametrize("bad", [["--network", "pods=4"], ["--network", "oversub=0.5"], ["--network", "pod=x"],
                                 ["--samples", "-1"], ["--stack", "megatron-1999"]])
def test_plan_new_flags_bad_values_are_one_line(capsys, bad):
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ndtrain plan: error:") and "\n" not in err


def test_plan_says_whether_the_token_budget_repays_a_compile(capsys, monkeypatch, tmp_path):
    """Each shown layout gets compile_auto's decision for a run of --tokens: GPUs price it (the
    catalog's compile time, the fused-elementwise saving), a layout whose compiled blocks the
    runtime refuses says so; an uncalibrated CPU gets no line."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "8192",
            "--global-batch-tokens", "1M", "--top", "1", "--layout", "dp_shard=8,micro_batch=1,activation_checkpoint=selective"]
    assert cli([*base, "--tokens", "15T"]) == 0
    assert "torch.compile on:" in capsys.readouterr().out
    zero_bubble = [*base[:-1], "dp_shard=4,pp=2,pp_schedule=InterleavedZeroBubble,pp_virtual_stages=2,micro_batch=1,activation_checkpoint=none"]
    assert cli([*zero_bubble, "--tokens", "15T"]) == 0
    assert "torch.compile off: InterleavedZeroBubble runs the backward in separate input and weight passes" \
        in capsys.readouterr().out
    assert cli([*base, "--tokens", "16M", "--json"]) == 0  # 16 steps repay no 60 s compile
    decision = json.loads(capsys.readouterr().out)["layouts"][0]["compile"]
    assert decision["compile"] is False and decision["steps"] == 15 and decision["breakeven_steps"] > 15
    import ndtrain.planner.hardware as hardware

    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "none.json")  # an uncalibrated CPU
    cpu = ["plan", "--model-shape", "layers=6,hidden=256,heads=16,kv_heads=16,ffn=768,vocab=2048", "--gpus", "2",
           "--gpu", "this-machine", "--seq", "256", "--global-batch", "8", "--precision", "fp32", "--top", "1"]
    assert cli(cpu) == 0
    out = capsys.readouterr().out
    assert "#1" in out and "torch.compile" not in out
