"""One stage of the prepared GPU check (benchmarks/gpu_check.sh runs every stage, each in its own
process under its own `timeout`, and prints the table).

    PYTHONPATH=src python benchmarks/gpu_check.py STAGE [--dry-run] [--out DIR]

Each stage prints exactly one JSON line last: {"stage", "result", "pass_means", "verdict"}, where
verdict is "pass", "FAIL", "info" (a figure with no threshold, or a dry run) or "skip" (cannot run
here: the reason is the result). The GPU machine may carry another torch than the pinned one
(2.11 was seen) and no torchao, so every stage says what it could not do in one line instead of
failing the whole check. `--dry-run` runs the same code on CPU at tiny shapes: the default test
suite runs it, so the script cannot rot unseen.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _device(dry: bool) -> torch.device:
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _peak_gib(fn, dev: torch.device) -> float:
    """Peak memory `fn()` allocates above what was allocated before it (GPU only; NaN on CPU)."""
    if dev.type != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**30


def _subprocess_json(args: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{Path(args[0]).name} exited {proc.returncode}: {tail[:200]}")
    return json.loads(lines[-1])


# ---- stages ----------------------------------------------------------------------------------
def stage_env(a) -> dict:
    import platform

    from ndtrain.planner.hardware import catalog_name

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"torchao {'yes' if importlib.util.find_spec('torchao') else 'NO'}"]
    if a.dry_run or not torch.cuda.is_available():
        parts.append("no CUDA (dry run)" if a.dry_run else "no CUDA device")
        return {"result": ", ".join(parts), "pass_means": "CUDA present, GPU in the planner's catalog",
                "verdict": "info" if a.dry_run else "FAIL"}
    props = torch.cuda.get_device_properties(0)
    cc = torch.cuda.get_device_capability(0)
    entry = catalog_name(props.name, props.total_memory)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    parts += [f"CUDA {torch.version.cuda}", f"NCCL {nccl}", f"{props.name} cc {cc[0]}.{cc[1]}",
              f"{props.total_memory / 2**30:.0f} GiB", f"{torch.cuda.device_count()} GPU(s)", f"catalog {entry}"]
    return {"result": ", ".join(parts), "pass_means": "CUDA present, GPU in the planner's catalog",
            "verdict": "pass" if entry else "FAIL"}


def stage_calibrate(a) -> dict:
    out = Path(a.out) / "gpu-profile.json"
    cmd = ["-m", "ndtrain", "calibrate", "--quick", "--device", "gpu", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=a.budget, env=env, cwd=ROOT)
    if a.dry_run:  # the GPU command line, accepted up to the missing GPU (the CPU calibration has its own tests)
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        ok = proc.returncode == 2 and "no CUDA device" in said
        return {"result": f"dry run: `calibrate --quick --device gpu` said {said[:120]!r}",
                "pass_means": "writes a profile the planner reads (`ndtrain plan --profile`)",
                "verdict": "info" if ok else "FAIL"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"result": f"exit {proc.returncode}: {tail[:200]}", "pass_means": "writes a profile", "verdict": "FAIL"}
    prof = json.loads(out.read_text())
    figures = prof.get("constants") or {k: v for k, v in prof.get("matmul", {}).items() if isinstance(v, (int, float))}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(figures.items())[:8])
    return {"result": f"{prof.get('catalog', 'cpu')} profile in {prof.get('seconds', 0):.0f} s: {shown}",
            "pass_means": "writes a profile the planner reads (`ndtrain plan --profile`)", "verdict": "pass"}


def stage_train(a, compile_: str) -> dict:
    if a.dry_run and compile_ == "on":  # the same code as train-eager's, but for the flag
        return {"result": "dry run: not compiled (a cold compile costs over a minute on 2 CPU cores; compiled "
                          "blocks have their own tests), train-eager ran this stage's code",
                "pass_means": "tokens/s and peak memory within 30% / 25% of the planner", "verdict": "info"}
    args = ["benchmarks/gpu_throughput.py", "--compile", compile_] + (["--dry-run"] if a.dry_run else [])
    r = _subprocess_json(args, a.budget)
    ratio_mem = r["peak_alloc_gib"] / r["planner_memory_gib"] if r["planner_memory_gib"] else float("nan")
    ratio_tps = r["tokens_per_s"] / r["planner_tokens_per_s"] if r.get("planner_tokens_per_s") else float("nan")
    result = (f"{r['preset']} bf16 compile {compile_}: {r['tokens_per_s']:,.0f} tok/s (planner {r.get('planner_tokens_per_s', 0):,.0f},"
              f" measured/planned {ratio_tps:.2f}), MFU {100 * r['mfu']:.1f}%, peak {r['peak_alloc_gib']:.1f} GiB"
              f" (planner {r['planner_memory_gib']:.1f}, {ratio_mem:.2f}x), warm-up {r['warmup_s']:.0f} s")
    ok = 0.7 <= ratio_tps <= 1.3 and 0.75 <= ratio_mem <= 1.25
    return {"result": result, "pass_means": "tokens/s and peak memory within 30% / 25% of the planner",
            "verdict": "info" if a.dry_run else ("pass" if ok else "FAIL")}


def stage_fp8(a) -> dict:
    if importlib.util.find_spec("torchao") is None:
        return {"result": "torchao is not installed (carry its wheel in the working tree)",
                "pass_means": "fp8 tokens/s > bf16", "verdict": "skip"}
    if not a.dry_run and torch.cuda.get_device_capability(0) < (8, 9):
        return {"result": "GPU below compute capability 8.9 has no fp8", "pass_means": "fp8 tokens/s > bf16",
                "verdict": "skip"}
    args = ["benchmarks/gpu_fp8_throughput.py", "--json"] + (["--dry-run"] if a.dry_run else ["--rounds", "2", "--steps", "4"])
    r = _subprocess_json(args, a.budget)
    tps = r["tokens_per_s"]
    speed = tps["fp8-tensorwise"] / tps["bf16"]
    dloss = abs(r["loss"]["fp8-tensorwise"] - r["loss"]["bf16"])
    return {"result": f"fp8/bf16 tokens/s {speed:.2f}x, loss diff {dloss:.3f}, peak GiB "
                      + " / ".join(f"{m} {v:.1f}" for m, v in r["peak_mem_gib"].items()),
            "pass_means": "fp8 (compiled, tensorwise) faster than bf16, loss within 0.05",
            "verdict": "info" if a.dry_run else ("pass" if speed > 1.0 and dloss < 0.05 else "FAIL")}


def _qkv(dev, dry: bool, grad: bool = True):
    b, h, h_kv, s, d = (1, 4, 2, 256, 32) if dry else (1, 32, 8, 8192, 128)
    dtype = torch.float32 if dry else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g).to(dev, dtype).requires_grad_(grad) for n in (h, h_kv, h_kv))
    return q, k, v


def stage_cp_attention(a) -> dict:
    """The kernels a context-parallel rank runs on one block (its own, causal) against SDPA."""
    from ndtrain.model.llama import expand_kv
    from ndtrain.parallel.ring_attention import block_backward, block_forward

    dev = _device(a.dry_run)
    q, k, v = _qkv(dev, a.dry_run, grad=False)
    ke, ve = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1])
    go = torch.randn_like(q)

    def ours():
        out, lse = block_forward(q, ke, ve, True, scale)
        return out, block_backward(go, q, ke, ve, out, lse, True, scale)

    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, ke, ve))

    def sdpa():
        out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        out.backward(go)
        return out

    t_ours, t_ref = _timed(ours, dev, 5), _timed(sdpa, dev, 5)
    m_ours, m_ref = _peak_gib(ours, dev), _peak_gib(sdpa, dev)
    qr.grad = None
    out, (dq, _, _) = ours()
    ref = sdpa()
    diff = max((out.float() - ref.float()).abs().max().item(), (dq.float() - qr.grad.float()).abs().max().item())
    tol = 1e-4 if a.dry_run else 5e-2  # fp32 reassociation / bf16 rounding of O(1) outputs
    ok = t_ours <= 1.5 * t_ref and (math.isnan(m_ours) or m_ours <= 2 * m_ref + 0.1) and diff <= tol
    return {"result": f"seq {q.shape[2]}: fwd+bwd {1e3 * t_ours:.1f} ms vs SDPA {1e3 * t_ref:.1f} ms "
                      f"({t_ours / t_ref:.2f}x), memory {m_ours:.2f} vs {m_ref:.2f} GiB, max abs diff {diff:.2e}",
            "pass_means": "within 1.5x SDPA flash's time, 2x its memory, difference within dtype rounding",
            "verdict": "info" if a.dry_run else ("pass" if ok else "FAIL")}


def stage_doc_mask(a) -> dict:
    from ndtrain.model.doc_attention import flex_document_attention
    from ndtrain.model.llama import document_causal_mask, expand_kv

    dev = _device(a.dry_run)
    train = not a.dry_run  # flex attention has no CPU backward (torch 2.13): the dry run times the forward
    q, k, v = _qkv(dev, a.dry_run, grad=train)
    ke, ve = expand_kv(k.detach(), q.shape[1]), expand_kv(v.detach(), q.shape[1])
    s = q.shape[2]
    doc_ids = (torch.arange(s, device=dev) * 8 // s)[None]  # 8 equal documents
    go = torch.randn_like(q)

    def flex():
        with torch.set_grad_enabled(train):
            out = flex_document_attention(q, ke, ve, doc_ids, compiled=not a.dry_run)
        if train:
            out.backward(go)
        return out

    def causal():
        with torch.set_grad_enabled(train):
            out = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
        if train:
            out.backward(go)
        return out

    t_flex, t_causal = _timed(flex, dev, 5), _timed(causal, dev, 5)
    with torch.no_grad():
        got = flex_document_attention(q, ke, ve, doc_ids, compiled=not a.dry_run)
        ref = F.scaled_dot_product_attention(q, ke, ve, attn_mask=document_causal_mask(doc_ids))
    diff = (got.float() - ref.float()).abs().max().item()
    tol = 1e-4 if a.dry_run else 5e-2
    return {"result": f"seq {s}, 8 documents: flex {'fwd+bwd' if train else 'fwd'} {1e3 * t_flex:.1f} ms vs full-causal SDPA "
                      f"{1e3 * t_causal:.1f} ms ({t_flex / t_causal:.2f}x), max abs diff vs dense mask {diff:.2e}",
            "pass_means": "no slower than full-causal flash (it skips 7/8 of the blocks), same result",
            "verdict": "info" if a.dry_run else ("pass" if t_flex <= t_causal and diff <= tol else "FAIL")}


def stage_ac_recompute(a) -> dict:
    """How many fp8 matmuls selective AC recomputes: backward should run 2 per forward one."""
    if importlib.util.find_spec("torchao") is None:
        return {"result": "torchao is not installed", "pass_means": "0 _scaled_mm recomputed", "verdict": "skip"}
    import contextlib

    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    @contextlib.contextmanager
    def counting():
        # torchao calls torch._scaled_mm from inside its float8 tensor subclass, below where a
        # dispatch mode would see it, so the function itself is wrapped.
        real, box = torch._scaled_mm, [0]

        def wrapped(*args, **kwargs):
            box[0] += 1
            return real(*args, **kwargs)

        torch._scaled_mm = wrapped
        try:
            yield box
        finally:
            torch._scaled_mm = real

    data = _corpus(a, 256 if a.dry_run else 128256)
    seq = 32 if a.dry_run else 2048
    cfg = load_config(None, {
        "model": {"preset": "debug" if a.dry_run else "llama3-1b", **({"n_layers": 1} if a.dry_run else {})},
        "data": {"path": str(data), "seq_len": seq},
        "parallel": {"dp_shard": 1, "mixed_precision": "fp8", "activation_checkpoint": "selective", "compile": False},
        "train": {"global_batch": 1, "micro_batch": 1, "device": "cpu" if a.dry_run else "cuda",
                  "val_interval": 0, "sample_tokens": 0},
        "logging": {"tensorboard": False, "progress": "off"}})
    trainer = Trainer(cfg, run_dir=None, log=False)
    x = torch.randint(0, cfg.model.vocab_size, (1, seq), device=trainer.state.rt.device)
    with torch.no_grad(), counting() as fwd:
        trainer.state.model(x)
    with counting() as total:
        trainer.state.model(x).float().sum().backward()
    trainer.close()
    fwd, total = fwd[0], total[0]
    recomputed = total - 3 * fwd  # a matmul's backward is two: the input's and the weight's gradient
    return {"result": f"{fwd} _scaled_mm in the forward, {total} in forward + backward: {recomputed} recomputed",
            "pass_means": "0 recomputed (selective AC saves fp8 matmul outputs)",
            "verdict": "pass" if recomputed == 0 and fwd > 0 else "FAIL"}


def stage_tf32(a) -> dict:
    from ndtrain.config import load_config
    from ndtrain.parallel.compose import set_fp32_matmul_precision

    dev = _device(a.dry_run)
    n = 256 if a.dry_run else 8192
    x, y = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    rates = {}
    for mode in ("ieee", "tf32"):  # what a run sets from [parallel] fp32_matmul_precision (CUDA only)
        set_fp32_matmul_precision(mode)
        rates[mode] = 2 * n**3 / _timed(lambda: x @ y, dev, 5)
    set_fp32_matmul_precision("ieee")
    key = load_config(None, {}).parallel.fp32_matmul_precision
    speed = rates["tf32"] / rates["ieee"]
    return {"result": f"fp32 {n}^3: IEEE {rates['ieee'] / 1e12:.3g}, TF32 {rates['tf32'] / 1e12:.3g} TFLOP/s "
                      f"({speed:.2f}x); [parallel] fp32_matmul_precision default {key!r}",
            "pass_means": "TF32 >= 3x IEEE on Hopper, and the run's default resolves to TF32 on CUDA",
            "verdict": "info" if a.dry_run else ("pass" if speed >= 3 else "FAIL")}


def stage_ckpt_stall(a) -> dict:
    from ndtrain.config import load_config
    from ndtrain.train.trainer import Trainer

    data = _corpus(a, 256 if a.dry_run else 128256)
    run = Path(a.out) / "ckpt-run"
    seq, mb = (32, 2) if a.dry_run else (2048, 4)
    cfg = load_config(None, {
        "model": {"preset": "debug" if a.dry_run else "llama3-1b"}, "data": {"path": str(data), "seq_len": seq},
        "parallel": {"dp_shard": 1, "mixed_precision": "bf16"},
        "checkpoint": {"dir": str(run / "checkpoints"), "async": True, "interval_steps": 0},
        "train": {"global_batch": mb, "micro_batch": mb, "device": "cpu" if a.dry_run else "cuda",
                  "val_interval": 0, "sample_tokens": 0, "output_dir": str(run)},
        "logging": {"tensorboard": False, "progress": "off"}})
    trainer = Trainer(cfg, run_dir=run, log=False)
    ckpt = trainer.checkpointer(run)
    steps = [trainer.train_step().seconds for _ in range(3)]
    ckpt.save()
    trainer.train_step()
    ckpt.wait()
    ckpt.finish()
    row = ckpt.history[-1]
    nbytes = sum(p.numel() * p.element_size() for p in trainer.state.model.parameters()) * 4  # weights + grads-free Adam x2 + master
    trainer.close()
    stall = row["checkpoint_stall_s"]
    rate = nbytes / stall / 1e9 if stall > 0 else float("inf")
    return {"result": f"async save paused training {stall:.2f} s (step {sorted(steps)[1]:.3f} s; ~{nbytes / 2**30:.1f} GiB "
                      f"staged, {rate:.1f} GB/s), written in {row['checkpoint_total_s']:.1f} s",
            "pass_means": "staging >= 10 GB/s (pinned device-to-host copies; pageable ones are ~3 GB/s)",
            "verdict": "info" if a.dry_run else ("pass" if rate >= 10 else "FAIL")}


def _corpus(a, vocab: int) -> Path:
    from gpu_fp8_throughput import synthetic_corpus

    return synthetic_corpus(Path(a.out) / f"data-{vocab}", vocab, 200_000 if a.dry_run else 2_000_000)


STAGES = {
    "env": stage_env, "calibrate": stage_calibrate,
    "train-eager": lambda a: stage_train(a, "off"), "train-compiled": lambda a: stage_train(a, "on"),
    "fp8": stage_fp8, "cp-attention": stage_cp_attention, "doc-mask": stage_doc_mask,
    "ac-recompute": stage_ac_recompute, "tf32": stage_tf32, "ckpt-stall": stage_ckpt_stall,
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the stage's code")
    p.add_argument("--out", default="", help="scratch directory (default: a new temporary one)")
    p.add_argument("--budget", type=float, default=240, help="seconds a stage's own subprocess may take")
    a = p.parse_args(argv)
    a.out = a.out or tempfile.mkdtemp(prefix="ndtrain-gpu-check-")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if not a.dry_run and a.stage != "env" and not torch.cuda.is_available():
        row = {"result": "no CUDA device", "pass_means": "-", "verdict": "skip"}
    else:
        try:
            row = STAGES[a.stage](a)
        except Exception as exc:  # one line per stage that cannot run, never a traceback
            text = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
            row = {"result": f"did not run: {type(exc).__name__}: {text}", "pass_means": "-", "verdict": "FAIL"}
    print(json.dumps({"stage": a.stage, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
