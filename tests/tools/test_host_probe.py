"""The host probe: one measurement per host, cached beside the calibration profile, deciding the
CPU defaults (cpu_matmul, bf16's attention dtype, the precision, fp8's warning) from its rates.
The decisions are tested on given rates (an AMD-like and an AMX-like host); one real probe run
checks that it caches and is re-used."""

from __future__ import annotations

import json

import pytest
import torch

import ndtrain.planner.hardware as hardware
from ndtrain.config import load_config
from ndtrain.planner import host_cache

CPUINFO = "model name\t: {model}\nflags\t\t: fpu avx2 avx512f {extra}\n"
AMD = CPUINFO.format(model="AMD EPYC", extra="avx512_bf16")
SPR = CPUINFO.format(model="Intel(R) Xeon(R) Platinum 8481C", extra="avx512_bf16 avx512_fp16 amx_tile amx_bf16")


def rates(fp32=60e9, bf16=150e9, onednn=1.15, attn_bf16=0.8, fp8=20e9, block=1.4):
    """Probe rates (FLOP/s): defaults as measured on the AMD host (oneDNN 1.15x the BLAS, bf16
    attention slower than attending in fp32, fp8 ~15% of bf16 at the small shape, a bf16 block
    1.4x an fp32 one)."""
    out = {"fp32_blas": fp32, "fp32_onednn": fp32 * onednn, "bf16": bf16, "bf16_small": 130e9, "fp8_small": fp8,
           "block_bf16_speedup": block}
    out["fp32"] = max(out["fp32_blas"], out["fp32_onednn"])
    for d in host_cache.ATTENTION_HEAD_DIMS:
        out.update({f"attn_fp32_d{d}": 15e9, f"attn_bf16_in_fp32_d{d}": 16e9,
                    f"attn_bf16_native_d{d}": 16e9 * attn_bf16})
    return out


def probe(cpuinfo=AMD, **kw) -> dict:
    key = host_cache.host_key(cpuinfo, "2.13.0+cpu", env={}, cores=2)
    r = rates(**kw)
    return {"key": key, "rates": r, "decisions": host_cache.decide(r, key["flags"]), "small_n": 128,
            "attention_seq": 256}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache directory of this test's own, with no calibration profile in it; `put` caches a
    probe under this host's real key (what the planner and the runtime look up)."""
    monkeypatch.setattr(hardware, "DEFAULT_PROFILE", tmp_path / "hardware.json")

    def put(p: dict) -> dict:
        p = {**p, "key": host_cache.host_key()}  # its decisions stay those of the host it imitates
        host_cache.write(p, tmp_path)
        return p
    return put


def test_decisions_follow_the_measured_rates():
    amd = probe()["decisions"]
    assert amd["cpu_matmul"] == "onednn" and set(amd["bf16_attention"].values()) == {"fp32"}
    assert amd["native_bf16"] and not amd["fp8_emulated"]
    # oneDNN within the noise margin of the BLAS, or slower: torch's own choice
    assert probe(onednn=1.01)["decisions"]["cpu_matmul"] == probe(onednn=0.9)["decisions"]["cpu_matmul"] == "blas"
    # bf16 attention measured faster (an AMX host): bf16 attends in bf16
    assert set(probe(attn_bf16=1.5)["decisions"]["bf16_attention"].values()) == {"bf16"}
    # fp8 at 0.03 GFLOP/s against bf16's 130 at the same shape: emulated (under 1%)
    spr = probe(SPR, fp8=0.03e9)["decisions"]
    assert spr["fp8_emulated"] and spr["fp8_ratio"] < 1e-3
    # no bf16 dot products in hardware (AVX2 only): not native, whatever the rates say
    assert not probe(CPUINFO.format(model="old", extra=""))["decisions"]["native_bf16"]


def test_the_attention_choice_is_the_nearest_probed_head_dim():
    chosen = {"bf16_attention": {"32": "fp32", "128": "bf16"}}
    assert [host_cache.bf16_attention(chosen, d) for d in (8, 32, 60, 70, 128, 256)] == \
        ["fp32", "fp32", "fp32", "bf16", "bf16", "bf16"]


def test_another_cpu_torch_or_isa_cap_is_another_probe(tmp_path):
    base = host_cache.host_key(AMD, "2.13.0+cpu", env={}, cores=2)
    others = [host_cache.host_key(SPR, "2.13.0+cpu", env={}, cores=2),
              host_cache.host_key(AMD, "2.14.0+cpu", env={}, cores=2),
              host_cache.host_key(AMD, "2.13.0+cpu", env={"ONEDNN_MAX_CPU_ISA": "AVX2"}, cores=2)]
    paths = {host_cache.cache_path(k, tmp_path) for k in [base, *others]}
    assert len(paths) == 4
    host_cache.write({**probe(), "key": base}, tmp_path)
    assert host_cache.cached_probe(tmp_path, base) is not None and host_cache.cached_probe(tmp_path, others[0]) is None
    host_cache.cache_path(others[1], tmp_path).write_text("{half a fi")  # a torn file is not an error
    host_cache.write({"key": others[2], "rates": {"fp32": 1.0}, "decisions": {}}, tmp_path)  # not a whole probe
    assert host_cache.cached_probe(tmp_path, others[1]) is None and host_cache.cached_probe(tmp_path, others[2]) is None


def test_the_uncalibrated_planner_and_the_mfu_peak_use_the_probe(cache, monkeypatch):
    """Before: the planner priced an uncalibrated CPU at 20 GFLOP/s fp32 (bf16 a quarter of it)
    and the runtime measured its own peak; now both read the cached probe."""
    from ndtrain.calibrate import peak_flops
    from ndtrain.train import metrics

    no_probe = hardware.this_machine()
    assert (no_probe.peak("fp32"), no_probe.peak("bf16")) == (20e9, 5e9)  # nothing cached: the defaults
    p = cache(probe(SPR, fp32=140e9, bf16=1452e9, fp8=0.03e9))
    hw = hardware.this_machine()
    assert (hw.peak("fp32"), hw.peak("bf16")) == (p["rates"]["fp32"], 1452e9)
    assert not hw.calibrated and "host probe" in hw.description
    assert hw.compile_s == 0 and not hw.cpu_compile_saving  # compile stays unpriced uncalibrated
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert peak_flops.probe_matmul_flops(torch.float32) == hw.peak("fp32")
        assert peak_flops.probe_matmul_flops(torch.bfloat16) == hw.peak("bf16")
        # fp8's emulated rate: the runtime's fp8 "peak" falls back to bf16's (run_peaks)
        peak, _, fp8, note = metrics.run_peaks(torch.device("cpu"), torch.bfloat16, fp8=True)
        assert peak == fp8 == 1452e9 and "below it" in note
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 ranks on 2 cores: each has half a core
        assert peak_flops.probe_matmul_flops(torch.float32) == pytest.approx(hw.peak("fp32") / 2)
    finally:
        torch.set_num_threads(threads)


PEERS = {"model": {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048},
         "data": {"seq_len": 256}, "train": {"global_batch": 8, "micro_batch": 4, "device": "cpu"}}


def test_host_choices_and_an_explicit_value_wins(cache, capsys):
    from ndtrain.train.plan import resolve_plan

    # an AMX host: bf16 ~10x fp32, its attention faster in bf16, oneDNN no faster than the BLAS
    cache(probe(SPR, fp32=140e9, bf16=1452e9, onednn=0.95, attn_bf16=1.6, block=4.0))
    cfg = load_config(None, PEERS)
    plan = resolve_plan(cfg, 2)
    assert (plan.layout.cpu_matmul, plan.layout.mixed_precision) == ("blas", "bf16") == (plan.host.cpu_matmul, plan.host.precision)
    assert (cfg.parallel.cpu_matmul, cfg.parallel.mixed_precision) == ("onednn", "fp32")  # the caller's stays
    # the kernel choice reaches the Trainer in the plan, and it sets it per model
    assert plan.host.bf16_attention == "bf16"
    assert plan.host.precision_speedup >= 1.5 and "precision bf16" in plan.explanation
    given = resolve_plan(load_config(None, {**PEERS, "parallel": {"cpu_matmul": "onednn", "mixed_precision": "fp32"}}), 2)
    assert (given.layout.cpu_matmul, given.layout.mixed_precision) == ("onednn", "fp32") and given.host.precision == ""
    # the AMD host: bf16 matmuls 2.2x fp32's, but a whole bf16 block only 1.4x; the planner
    # predicts under 1.5x and fp32 stays
    cache(probe(AMD))
    plan = resolve_plan(load_config(None, PEERS), 2)
    assert plan.layout.mixed_precision == "fp32" and plan.host.precision_speedup < 1.5
    # a stored config (a checkpoint's) decides again, as compile_auto does
    from ndtrain.config import from_dict, to_dict

    assert from_dict(to_dict(plan.config)).parallel.mixed_precision_auto
    # fp8 chosen where it is emulated: one line, once
    cache(probe(SPR, fp32=140e9, bf16=1452e9, fp8=0.03e9))
    capsys.readouterr()
    resolve_plan(load_config(None, {**PEERS, "parallel": {"mixed_precision": "fp8"}}), 2)
    resolve_plan(load_config(None, {**PEERS, "parallel": {"mixed_precision": "fp8"}}), 2)
    err = [line for line in capsys.readouterr().err.splitlines() if "fp8" in line]
    assert len(err) == 1 and "emulated" in err[0] and "bf16" in err[0]


def test_bf16_attention_switch_changes_only_the_kernel_dtype():
    """Attending in bf16 or in fp32 computes the same attention: within bf16's rounding of the
    output (unit roundoff 2^-8 relative, on values of order 1: 2e-2 absolute covers a few ulps)."""
    from ndtrain.model import llama
    from ndtrain.model.config import preset
    from ndtrain.model.llama import build_model

    q, k, v = (torch.randn(2, 4, 32, 16, dtype=torch.bfloat16) for _ in range(3))
    native = llama.causal_sdpa(q, k, v, bf16_attends_in="bf16")
    in_fp32 = llama.causal_sdpa(q, k, v)  # the default: fp32
    assert native.dtype == in_fp32.dtype == torch.bfloat16
    assert (native.float() - in_fp32.float()).abs().max() < 2e-2
    # A per-model choice, not a process-wide one: one model's kernel changes, another's does not.
    a, b = build_model(preset("debug"), "cpu"), build_model(preset("debug"), "cpu")
    llama.set_cpu_bf16_attention(a, "bf16")
    kernels = lambda m: {mod.sdpa for mod in m.modules() if isinstance(mod, llama.Attention)}  # noqa: E731
    assert all(k.keywords == {"bf16_attends_in": "bf16"} for k in kernels(a)) and kernels(b) == {llama.causal_sdpa}
    assert all(llama.plain_kernel(k) for k in kernels(a))  # still the model's own kernel
    llama.set_cpu_bf16_attention(a, "fp32")
    assert kernels(a) == {llama.causal_sdpa}
    with pytest.raises(ValueError, match="fp32 or bf16"):
        llama.set_cpu_bf16_attention(a, "fp16")


def test_the_trainer_sets_the_chosen_attention_kernel_on_its_model(parity_base):
    """The probe's bf16 attention choice reaches the model the Trainer builds (and only it)."""
    import dataclasses

    from ndtrain.model import llama
    from ndtrain.train.plan import HostChoice, as_written
    from ndtrain.train.trainer import Trainer

    cfg = load_config(None, {**parity_base, "parallel": {"mixed_precision": "bf16"},
                             "train": {**parity_base["train"], "device": "cpu", "sample_tokens": 0}})
    plan = dataclasses.replace(as_written(cfg, 1), host=HostChoice("a probe", "onednn", bf16_attention="bf16"))
    trainer = Trainer(cfg, run_dir=None, log=False, plan=plan)
    kernels = {m.sdpa for m in trainer.state.model.modules() if isinstance(m, llama.Attention)}
    trainer.close()
    assert kernels and all(getattr(k, "keywords", None) == {"bf16_attends_in": "bf16"} for k in kernels)
    assert trainer.train_step  # built and usable


@pytest.mark.timeout(120)
def test_a_real_probe_is_cached_and_reused(cache, monkeypatch):
    from ndtrain.calibrate import host_probe

    first = host_probe.ensure()
    path = host_cache.cache_path(host_cache.host_key(), hardware.probe_dir())
    assert path.exists() and json.loads(path.read_text())["rates"] == first["rates"]
    r = first["rates"]
    assert all(r[k] > 0 for k in ("fp32_blas", "fp32_onednn", "bf16", "bf16_small", "attn_fp32_d32"))
    assert first["decisions"] == host_cache.decide(r, first["key"]["flags"])
    monkeypatch.setattr(host_probe, "measure", lambda: pytest.fail("measured again"))
    assert host_probe.ensure() == first  # re-used, not measured
    assert hardware.this_machine().peak("fp32") == r["fp32"]
