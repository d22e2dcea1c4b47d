"""FP8 training (parallel/float8.py, layout/fp8.py): which layers convert, what fp8 refuses, and
fp8-vs-bf16 loss curves over 30 steps at world 1 and FSDP world 2, tensorwise (FSDP x TP world
4, rowwise and the other compositions are in test_fp8_layouts.py, slow).

Tolerance of the curves (measured, see docs/fp8.md): fp8 and bf16 runs start from the same
weights and see the same batches. e4m3 keeps 3 mantissa bits, so single steps of the debug
model moved by up to 0.065 (world 1, tensorwise) and on average by <= 0.008 over 30 steps (all
layouts and both recipes). The bounds below are about 1.5x and 2.5x those: a wrong scale,
a lost gradient or a layer computed in the wrong precision moves the curve by far more (and
the test also checks that fp8 GEMMs really ran, and changed the curve at all)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ndtrain.config import load_config
from ndtrain.errors import ConfigError
from ndtrain.layout.fp8 import converts, fp8_linears, model_linears, problems
from ndtrain.model.config import preset
from ndtrain.parallel.dims import ParallelDims, resolve

STEPS = 30
MAX_STEP_DIFF = 0.1  # |loss_fp8 - loss_bf16| at any step
MEAN_DIFF = 0.02  # mean over the 30 steps
FINAL_REL = 0.01  # mean of the last 5 losses, relative

DEBUG_FP8_TP1 = [f"layers.{i}.{m}" for i in range(4) for m in
                 ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]


def _base(parity_base, **parallel) -> dict:
    base = {k: dict(v) for k, v in parity_base.items()}
    # Real training (warm-up, then a higher lr) so 30 steps move the loss from 5.5 to ~3.2.
    base["optimizer"] = {"lr": 3e-3, "warmup_steps": 5}
    base["train"]["steps"] = STEPS
    base["parallel"] = parallel
    return base


def _check_curves(fp8: torch.Tensor, bf16: torch.Tensor, label: str) -> None:
    d = (fp8 - bf16).abs()
    assert bf16[-1] < bf16[0] - 1.5, f"{label}: the bf16 run did not train ({bf16.tolist()})"
    assert float(d.max()) <= MAX_STEP_DIFF, f"{label}: max |Δloss| {float(d.max()):.4f}"
    assert float(d.mean()) <= MEAN_DIFF, f"{label}: mean |Δloss| {float(d.mean()):.4f}"
    rel = abs(float(fp8[-5:].mean() / bf16[-5:].mean()) - 1)
    assert rel <= FINAL_REL, f"{label}: last-5 mean differs by {rel:.2%}"
    assert float(d.mean()) > 1e-4, f"{label}: identical to bf16, fp8 did not run"


# ---- the rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["debug", "debug-moe", "tiny", "llama3-1b"])
def test_rule_describes_the_runtime_model(name):
    """layout/fp8.py enumerates the model's Linear layers without torch: it must be exactly what
    model/llama.py builds (names and shapes), or the planner would price another model."""
    from ndtrain.model.llama import build_model

    cfg = preset(name)
    model = build_model(cfg, "meta")
    built = sorted((n, m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert built == sorted(model_linears(cfg))


@pytest.mark.parametrize("name,tp", [("debug", 1), ("debug", 4), ("debug-moe", 2), ("tiny", 1)])
def test_runtime_converts_exactly_the_rule(name, tp):
    from ndtrain.model.llama import build_model
    from ndtrain.parallel.float8 import apply_float8, is_float8

    cfg = load_config(None, {"model": {"preset": name}, "parallel": {"mixed_precision": "fp8"}})
    model = build_model(cfg.model, "meta")
    returned = apply_float8(model, ParallelDims(tp=tp, mp="fp8", fp8_recipe=cfg.parallel.fp8_recipe))
    swapped = sorted(n for n, m in model.named_modules() if is_float8(m))
    assert swapped == sorted(returned) == sorted(fp8_linears(cfg.model, tp))
    assert "output" not in swapped and swapped


def test_debug_model_layers_that_qualify():
    """Debug model (dim 64, ffn 192, 8 heads of 8, 4 kv-heads): every block Linear qualifies at
    tp <= 2; at tp = 4 wk/wv (32 outputs, 8 per rank) fall below 16 per rank and stay bf16."""
    cfg = preset("debug")
    assert fp8_linears(cfg, 1) == fp8_linears(cfg, 2) == DEBUG_FP8_TP1
    assert fp8_linears(cfg, 4) == [n for n in DEBUG_FP8_TP1 if not n.endswith(("wk", "wv"))]
    assert not converts("output", 64, 256)
    assert not converts("layers.0.attention.wq", 64, 40)
    moe = preset("debug-moe")
    assert not any("router" in n or "shared_experts" in n for n in fp8_linears(moe))


# ---- what fp8 refuses --------------------------------------------------------------------------

def test_fp8_refusals_name_their_key():
    fp8 = ParallelDims(mp="fp8")
    assert problems(fp8, preset("debug"), 64) == []
    odd = preset("debug", dim=40, n_heads=4, n_kv_heads=2, ffn_dim=120)
    assert [k for k, _ in problems(fp8, odd, 64)] == ["parallel.mixed_precision"]
    assert [k for k, _ in problems(fp8, preset("debug"), 40)] == ["data.seq_len"]
    assert [k for k, _ in problems(ParallelDims(mp="fp8", cp=2), preset("debug"), 48)] == ["data.seq_len"]
    # The rules run inside the one validity check, with the key they name.
    from ndtrain.layout import problems as layout_problems

    assert [p.key for p in layout_problems(ParallelDims(mp="fp8", dp_shard=1), odd, 1, 64)] == ["parallel.mixed_precision"]
    with pytest.raises(ConfigError, match="parallel.fp8_recipe"):
        load_config(None, {"parallel": {"mixed_precision": "fp8", "fp8_recipe": "blockwise"}})
    # 48 is a multiple of 16, not of 16 x tp: known without a world, so the config itself is refused.
    with pytest.raises(ConfigError, match="parallel.mixed_precision"):
        load_config(None, {"parallel": {"mixed_precision": "fp8", "tp": 2, "dp_shard": 1},
                           "model": {"dim": 48, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96}})


def test_bad_fp8_layout_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys

    marker = tmp_path / "keep.txt"
    marker.write_text("x")
    config = Path(__file__).resolve().parents[2] / "configs" / "debug.toml"
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", "--config", str(config),
                           "--parallel.mixed_precision=fp8", "--data.seq_len=40",
                           f"--train.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.seq_len" in lines[0] and "Traceback" not in proc.stderr
    assert marker.read_text() == "x" and not (tmp_path / "run").exists()


# ---- fp8 vs bf16 curves ------------------------------------------------------------------------

def one_process_curves(parity_base, recipe: str) -> None:
    """World 1 (bf16 autocast), 30 steps; fp8 GEMMs counted as they run."""
    from ndtrain.tools.verify import run_steps

    calls = []
    scaled_mm = torch._scaled_mm

    def counting(a, b, **kw):
        if not a.shape == b.shape == (512, 512):  # the trainer's fp8 peak probe (metrics.py)
            calls.append((a.dtype, b.dtype))
        return scaled_mm(a, b, **kw)

    bf16 = run_steps(load_config(None, _base(parity_base, mixed_precision="bf16")), STEPS)["losses"]
    torch._scaled_mm = counting
    try:
        fp8 = run_steps(load_config(None, _base(parity_base, mixed_precision="fp8", fp8_recipe=recipe)), STEPS)
    finally:
        torch._scaled_mm = scaled_mm
    # 28 converted layers x 3 GEMMs (output, input grad, weight grad) per step, all fp8.
    assert len(calls) == 28 * 3 * STEPS and all(a.itemsize == b.itemsize == 1 for a, b in calls)
    _check_curves(fp8["losses"], bf16, f"world 1 {recipe}")


def test_fp8_tracks_bf16_in_one_process(parity_base):
    """Tensorwise here; rowwise in test_fp8_layouts.py (slow: fp8 GEMMs are slow on CPU)."""
    one_process_curves(parity_base, "tensorwise")


def _fsdp_probe(cfgs, steps):
    """On each rank: the runs' losses, plus what the fp8 run's weights are."""
    from ndtrain.tools.verify import run_steps
    from ndtrain.train.trainer import Trainer

    out = [run_steps(cfg, steps)["losses"] for cfg in cfgs]
    trainer = Trainer(cfgs[-1], run_dir=None, log=False)
    kinds = sorted({type(m.weight._local_tensor).__name__ for m in trainer.model.modules()
                    if type(m).__name__ == "Float8Linear"})
    trainer.close()
    return out, kinds


@pytest.mark.timeout(300)
def test_fp8_tracks_bf16_under_fsdp(parity_base):
    """FSDP world 2, tensorwise: fp8 matmuls and float8 all-gather of the sharded weights."""
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.tools.verify import layout_config

    base = _base(parity_base)
    cfgs = [layout_config(base, f"dp_shard=2,mp={mp}") for mp in ("bf16", "fp8")]
    (bf16, fp8), kinds = run_ranks(2, _fsdp_probe, cfgs, STEPS)[0]
    assert kinds == ["WeightWithDynamicFloat8CastTensor"]  # torchao's float8 all-gather weight
    _check_curves(fp8, bf16, "FSDP world 2 tensorwise")


def test_fp8_mfu_names_both_peaks(parity_base, capsys):
    """fp8 runs log MFU against the bf16 peak (`mfu`) and the fp8 peak (`mfu_fp8`), and say which."""
    from ndtrain.train.metrics import MetricsLogger
    from ndtrain.train.trainer import Trainer

    rows = {}
    for mp in ("bf16", "fp8"):
        trainer = Trainer(load_config(None, _base(parity_base, mixed_precision=mp)), run_dir=None, log=False)
        rows[mp] = trainer.metrics_row(trainer.train_step())
        trainer.close()
    assert "mfu_fp8" not in rows["bf16"]
    fp8 = rows["fp8"]
    assert 0 < fp8["mfu"] and 0 < fp8["mfu_fp8"]
    # The fp8 peak a run divides by is never below its bf16 one (on a CPU _scaled_mm is emulated
    # and measures slower than bf16: counting against it printed "185.8% of fp8 peak"), so the
    # fp8 MFU is at most the bf16 one, and no MFU is above 100%.
    assert fp8["mfu_fp8"] <= fp8["mfu"] <= 1
    log = MetricsLogger(None, False, 1, "off", False)  # the progress line, without files
    log.enabled = True
    log._show({**fp8, "last": True})
    line = capsys.readouterr().out
    assert "of bf16 peak" in line and "of fp8 peak" in line
