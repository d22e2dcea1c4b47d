"""Bad input, across every subcommand: each case must exit non-zero (2 for usage and config
errors), print exactly one error line on stderr with no traceback, name the offending key or
path, and leave every file that existed before byte for byte as it was.

All cases run in ONE subprocess (tests/cli/bad_input_runner.py) that calls `ndtrain.cli.main`
in-process and captures file descriptors 1 and 2, so what is checked is what a terminal would
show, torch's own messages included. The inputs (a trained run, a Hugging Face export, damaged
copies) are built once here."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

RUNNER = Path(__file__).with_name("bad_input_runner.py")


@dataclass
class Case:
    id: str
    argv: Callable  # (world, case_dir) -> argv
    names: str  # regex (case-insensitive) the error line must match: the key or path at fault
    rc: int = 2
    prep: Callable | None = None  # (world, case_dir) -> None: builds this case's inputs
    lock: bool | str = False  # a live process (this one) holds the lock of case_dir/out (or of this) while it runs
    absent: tuple = ()  # glob patterns (relative to case_dir) that must match nothing afterwards
    extra_roots: tuple = field(default_factory=tuple)
    env: dict = field(default_factory=dict)  # environment variables set for this case only


# ---- inputs ------------------------------------------------------------------------------------
def T(w, d, *more):
    """A small, otherwise valid training command line writing to the case's own directory."""
    return ["train", f"--data.path={w['corpus']}", "--data.seq_len=64", "--train.global_batch=8",
            "--train.micro_batch=8", "--train.steps=2", "--train.sample_tokens=0", "--train.val_interval=0",
            "--logging.tensorboard=false", "--logging.progress=off", f"--train.output_dir={d / 'out'}", *more]


def copy_ckpt(w, d) -> Path:
    dst = d / "ckpt" / w["ckpt"].name
    shutil.copytree(w["ckpt"], dst)
    return dst


def flip_byte(w, d):
    shard = copy_ckpt(w, d) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def evil_metadata(w, d):
    from ndtrain.train.checkpoint import write_manifest

    ckpt = copy_ckpt(w, d)
    canary = d / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (canary,))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload()))
    write_manifest(ckpt)


def edit_state(**changes):
    def prep(w, d):
        from ndtrain.train.checkpoint import write_manifest

        ckpt = copy_ckpt(w, d)
        state = json.loads((ckpt / "train_state.json").read_text())
        for key, value in changes.items():
            if key.startswith("model."):
                state["config"]["model"][key[6:]] = value
            else:
                state[key] = value
        (ckpt / "train_state.json").write_text(json.dumps(state))
        write_manifest(ckpt)  # consistent checksums: the content itself is what is wrong
    return prep


def state_text(text):
    def prep(w, d):
        from ndtrain.train.checkpoint import write_manifest

        ckpt = copy_ckpt(w, d)
        (ckpt / "train_state.json").write_text(text)
        write_manifest(ckpt)
    return prep


def write(rel, text="", binary=None):
    def prep(w, d):
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(binary) if binary is not None else p.write_text(text)
    return prep


def hf_with(edit=None, drop=None, extra=None):
    """A copy of the exported Hugging Face directory with config.json edited."""
    def prep(w, d):
        shutil.copytree(w["hf"], d / "hf")
        cfg_path = d / "hf" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        for k in drop or ():
            cfg.pop(k, None)
        cfg.update(edit or {})
        cfg_path.write_text(json.dumps(cfg))
        if extra:
            extra(d / "hf")
    return prep


def both(*preps):
    def prep(w, d):
        for p in preps:
            p(w, d)
    return prep


def pickle_only(hf: Path):
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")


def traversal_index(hf: Path):
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))


def garbage_weights(hf: Path):
    (hf / "model.safetensors").write_bytes(b"not a safetensors file at all")


def small_corpus(w, d):
    """A corpus of one source that a later `prepare --out` of the same settings appends to."""
    from ndtrain.data.prepare import prepare

    prepare([str(d / "good.jsonl")], d / "corpus", workers=1)


def ckpt(d):
    return d / "ckpt" / "step_00000004"


GOOD_GOODPUT = ["--gpus", "1024", "--mtbf-gpu-hours", "50000", "--ckpt-save", "60s", "--restart", "10m"]
PLAN = ["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "512"]

# ---- the cases ---------------------------------------------------------------------------------
CASES = [
    # train: every numeric key rejects nan/inf and nonsense values, naming the key
    Case("train-lr-nan", lambda w, d: T(w, d, "--optimizer.lr=nan"), r"optimizer\.lr"),
    Case("train-lr-inf", lambda w, d: T(w, d, "--optimizer.lr=inf"), r"optimizer\.lr"),
    Case("train-lr-negative", lambda w, d: T(w, d, "--optimizer.lr=-1"), r"optimizer\.lr"),
    Case("train-eps-nan", lambda w, d: T(w, d, "--optimizer.eps=nan"), r"optimizer\.eps"),
    Case("train-betas-nan", lambda w, d: T(w, d, "--optimizer.betas=[0.9, nan]"), r"optimizer\.betas"),
    Case("train-weight-decay-negative", lambda w, d: T(w, d, "--optimizer.weight_decay=-0.1"), r"optimizer\.weight_decay"),
    Case("train-grad-clip-inf", lambda w, d: T(w, d, "--optimizer.grad_clip=inf"), r"optimizer\.grad_clip"),
    Case("train-min-lr-ratio", lambda w, d: T(w, d, "--optimizer.min_lr_ratio=2"), r"optimizer\.min_lr_ratio"),
    Case("train-warmup-negative", lambda w, d: T(w, d, "--optimizer.warmup_steps=-3"), r"optimizer\.warmup_steps"),
    Case("train-timeout-inf", lambda w, d: T(w, d, "--train.timeout_s=inf"), r"train\.timeout_s"),
    Case("train-timeout-zero", lambda w, d: T(w, d, "--train.timeout_s=0"), r"train\.timeout_s"),
    Case("train-deadline-negative", lambda w, d: T(w, d, "--train.step_deadline_s=-1"), r"train\.step_deadline_s"),
    Case("train-time-budget-negative", lambda w, d: T(w, d, "--train.time_budget_s=-1"), r"train\.time_budget_s"),
    Case("train-time-budget-inf", lambda w, d: T(w, d, "--train.time_budget_s=inf"), r"train\.time_budget_s"),
    Case("train-straggler-nan", lambda w, d: T(w, d, "--train.straggler_threshold=nan"), r"train\.straggler_threshold"),
    Case("model-rope-theta-negative", lambda w, d: T(w, d, "--model.rope_theta=-1"), r"model\.rope_theta"),
    Case("model-norm-eps-nan", lambda w, d: T(w, d, "--model.norm_eps=nan"), r"model\.norm_eps"),
    Case("model-init-std-zero", lambda w, d: T(w, d, "--model.init_std=0"), r"model\.init_std"),
    Case("model-experts-negative", lambda w, d: T(w, d, "--model.n_experts=-1"), r"model\.n_experts"),
    Case("model-dim-zero", lambda w, d: T(w, d, "--model.dim=0"), r"model\.dim"),
    Case("model-preset-unknown", lambda w, d: T(w, d, "--model.preset=huge"), r"model\.preset"),
    Case("data-max-mb-nan", lambda w, d: T(w, d, "--data.max_mb=nan"), r"data\.max_mb"),
    Case("data-seq-len-zero", lambda w, d: T(w, d, "--data.seq_len=0"), r"data\.seq_len"),
    Case("data-seq-len-too-long", lambda w, d: T(w, d, "--data.seq_len=100000"), r"data\.seq_len"),
    Case("data-tokenizer-unknown", lambda w, d: T(w, d, "--data.tokenizer=words"), r"data\.tokenizer"),
    Case("train-steps-zero", lambda w, d: T(w, d, "--train.steps=0"), r"train\.steps"),
    Case("train-steps-float", lambda w, d: T(w, d, "--train.steps=1.5"), r"train\.steps"),
    Case("train-steps-string", lambda w, d: T(w, d, "--train.steps=many"), r"train\.steps"),
    Case("train-seed-negative", lambda w, d: T(w, d, "--train.seed=-1"), r"train\.seed"),
    Case("train-sample-tokens-negative", lambda w, d: T(w, d, "--train.sample_tokens=-1"), r"train\.sample_tokens"),
    Case("train-sample-prompt-empty", lambda w, d: T(w, d, "--train.sample_tokens=5", "--train.sample_prompt="),
         r"train\.sample_prompt"),
    Case("train-val-batches-negative", lambda w, d: T(w, d, "--train.val_batches=-1"), r"train\.val_batches"),
    Case("train-global-batch-zero", lambda w, d: T(w, d, "--train.global_batch=0"), r"train\.global_batch"),
    Case("train-device-unknown", lambda w, d: T(w, d, "--train.device=tpu"), r"train\.device"),
    Case("train-backend-unknown", lambda w, d: T(w, d, "--train.backend=mpi"), r"train\.backend"),
    Case("train-batch-ramp-malformed", lambda w, d: T(w, d, "--train.batch_ramp=[[1]]"), r"train\.batch_ramp"),
    Case("train-batch-ramp-auto-max", lambda w, d: T(w, d, "--train.batch_ramp=auto", "--train.batch_auto_max=3"),
         r"train\.batch_auto_max"),
    Case("optimizer-batch-lr-rule-unknown", lambda w, d: T(w, d, "--optimizer.batch_lr_rule=cube"), r"optimizer\.batch_lr_rule"),
    Case("train-overwrite-not-bool", lambda w, d: T(w, d, "--train.overwrite=yes"), r"train\.overwrite"),
    Case("logging-progress-unknown", lambda w, d: T(w, d, "--logging.progress=maybe"), r"logging\.progress"),
    Case("checkpoint-keep-last-zero", lambda w, d: T(w, d, "--checkpoint.keep_last=0"), r"checkpoint\.keep_last"),
    Case("checkpoint-interval-negative", lambda w, d: T(w, d, "--checkpoint.interval_steps=-1"),
         r"checkpoint\.interval_steps"),
    Case("train-zero-2-old-meaning", lambda w, d: T(w, d, "--parallel.zero=2"), r"parallel\.zero"),
    Case("train-zero-1-resharding", lambda w, d: T(w, d, "--parallel.zero=1", "--parallel.reshard_after_forward=true"),
         r"parallel\.reshard_after_forward"),
    Case("train-schedule-unknown-pp1", lambda w, d: T(w, d, "--parallel.pp_schedule=Nope"), r"parallel\.pp_schedule"),
    Case("train-fp8-recipe-unknown", lambda w, d: T(w, d, "--parallel.mixed_precision=fp8",
                                                    "--parallel.fp8_recipe=blockwise"), r"parallel\.fp8_recipe"),
    Case("train-cp-attention-unknown", lambda w, d: T(w, d, "--parallel.cp_attention=tree"), r"parallel\.cp_attention"),
    Case("train-cpu-matmul-unknown", lambda w, d: T(w, d, "--parallel.cpu_matmul=mkl"), r"parallel\.cpu_matmul"),
    Case("train-fp32-matmul-unknown", lambda w, d: T(w, d, "--parallel.fp32_matmul_precision=high"), r"parallel\.fp32_matmul_precision"),
    Case("train-compile-auto-not-bool", lambda w, d: T(w, d, "--parallel.compile_auto=sometimes"),
         r"parallel\.compile_auto"),
    Case("train-auto-not-bool", lambda w, d: T(w, d, "--parallel.auto=maybe"), r"parallel\.auto"),
    Case("train-document-mask-not-bool", lambda w, d: T(w, d, "--data.document_mask=maybe"), r"data\.document_mask"),
    Case("train-mix-not-list", lambda w, d: T(w, d, "--data.mix=web"), r"data\.mix"),
    Case("train-mix-negative-weight", lambda w, d: T(w, d, '--data.mix=[["web", -1]]'), r"data\.mix"),
    Case("train-mix-component-missing", lambda w, d: T(w, d, f"--data.path={d}", '--data.mix=[["web", 1]]'),
         r"web/manifest\.json"),
    Case("train-prefetch-negative", lambda w, d: T(w, d, "--data.prefetch=-1"), r"data\.prefetch"),
    Case("train-trackers-not-list", lambda w, d: T(w, d, "--logging.trackers=nope"), r"logging\.trackers"),
    Case("train-pipeline-trace-step-negative", lambda w, d: T(w, d, "--logging.pipeline_trace_step=-1"),
         r"logging\.pipeline_trace_step"),
    Case("config-unknown-section", lambda w, d: T(w, d, "--nope.key=1"), r"nope"),
    Case("config-unknown-key", lambda w, d: T(w, d, "--train.nope=1"), r"train\.nope"),
    Case("config-override-without-value", lambda w, d: T(w, d, "--train.steps"), r"train\.steps"),
    Case("train-positional-garbage", lambda w, d: T(w, d, "garbage"), r"garbage"),
    Case("train-nproc-not-int", lambda w, d: T(w, d, "--nproc", "abc"), r"--nproc"),
    Case("train-nproc-negative", lambda w, d: T(w, d, "--nproc=-2"), r"--nproc"),
    Case("train-max-restarts-negative", lambda w, d: T(w, d, "--max-restarts=-1"), r"--max-restarts"),
    Case("train-config-missing", lambda w, d: T(w, d, "--config", str(d / "nope.toml")), r"nope\.toml"),
    Case("train-config-not-toml", lambda w, d: T(w, d, "--config", str(d / "bad.toml")), r"bad\.toml",
         prep=write("bad.toml", "[train\nsteps = ")),
    Case("train-config-section-not-table", lambda w, d: T(w, d, "--config", str(d / "flat.toml")), r"train",
         prep=write("flat.toml", "train = 3\n")),
    # a config saved by PowerShell's `>` (UTF-16 with a byte-order mark) is read: its bad key is named
    Case("train-config-utf16-unknown-key", lambda w, d: T(w, d, "--config", str(d / "u16.toml")), r"train\.stepz",
         prep=write("u16.toml", binary="[train]\nstepz = 3\n".encode("utf-16"))),
    Case("train-config-not-utf8", lambda w, d: T(w, d, "--config", str(d / "latin.toml")), r"latin\.toml.*UTF-8",
         prep=write("latin.toml", binary="[train]\nsteps = 3  # caf\u00e9\n".encode("latin-1"))),
    # train: paths, validated before any work
    Case("train-output-dir-under-file", lambda w, d: T(w, d, f"--train.output_dir={d / 'file' / 'x'}"),
         r"train\.output_dir", prep=write("file", "x")),
    Case("train-output-dir-is-file", lambda w, d: T(w, d, f"--train.output_dir={d / 'file'}"), r"train\.output_dir",
         prep=write("file", "x")),
    Case("train-checkpoint-dir-under-file", lambda w, d: T(w, d, f"--checkpoint.dir={d / 'file' / 'c'}"),
         r"checkpoint\.dir", prep=write("file", "x")),
    Case("train-data-missing", lambda w, d: T(w, d)[:1] + [f"--data.path={d / 'nodata'}"] + T(w, d)[2:], r"nodata"),
    Case("train-data-manifest-garbage", lambda w, d: T(w, d)[:1] + [f"--data.path={d / 'data'}"] + T(w, d)[2:],
         r"manifest", prep=write("data/manifest.json", "{not json")),
    Case("train-vocab-too-small", lambda w, d: T(w, d, "--model.vocab_size=100"), r"model\.vocab_size"),
    Case("train-val-batches-too-many", lambda w, d: T(w, d, "--train.val_interval=1", "--train.val_batches=100000"),
         r"train\.val_batches"),
    # train: a run directory belongs to one run
    Case("train-fresh-run-in-used-dir", lambda w, d: T(w, d, f"--train.output_dir={w['run']}"),
         r"holds an earlier run.*--checkpoint\.resume=auto"),
    Case("train-nproc-fresh-run-in-used-dir", lambda w, d: T(w, d, "--nproc", "2", f"--train.output_dir={w['run']}"),
         r"holds an earlier run"),
    Case("train-run-dir-locked", lambda w, d: T(w, d), r"in use by a live run", lock=True),
    Case("train-resume-auto-no-output-dir",
         lambda w, d: [a for a in T(w, d) if not a.startswith("--train.output_dir")] + ["--checkpoint.resume=auto"],
         r"checkpoint\.resume"),
    Case("train-resume-auto-missing-dir", lambda w, d: T(w, d, "--checkpoint.resume=auto"), r"checkpoint\.resume.*out"),
    Case("train-resume-missing-path", lambda w, d: T(w, d, f"--checkpoint.resume={d / 'gone'}"), r"gone"),
    Case("train-resume-pickle-file", lambda w, d: T(w, d, f"--checkpoint.resume={d / 'model.pt'}"), r"pickle",
         prep=write("model.pt", binary=b"\x80\x04\x95\x00")),
    Case("train-resume-empty-dir", lambda w, d: T(w, d, f"--checkpoint.resume={d / 'empty'}"), r"empty",
         prep=lambda w, d: (d / "empty").mkdir()),
    Case("train-resume-other-model", lambda w, d: T(w, d, f"--checkpoint.resume={w['ckpt']}", "--model.dim=128"),
         r"model\.dim"),
    Case("train-resume-corrupt", lambda w, d: T(w, d, f"--checkpoint.resume={ckpt(d)}"), r"SHA-256", prep=flip_byte),
    Case("train-resume-state-step-string", lambda w, d: T(w, d, f"--checkpoint.resume={ckpt(d)}"), r"'step'",
         prep=edit_state(step="four")),
    Case("train-resume-state-loader-missing", lambda w, d: T(w, d, f"--checkpoint.resume={ckpt(d)}"), r"loader",
         prep=edit_state(loader=None)),
    Case("train-resume-state-not-json", lambda w, d: T(w, d, f"--checkpoint.resume={ckpt(d)}"), r"train_state",
         prep=state_text("{oops")),
    Case("train-resume-evil-metadata", lambda w, d: T(w, d, f"--checkpoint.resume={ckpt(d)}"),
         r"refused to read checkpoint metadata", prep=evil_metadata, absent=("pwned",)),
    Case("train-nproc-global-batch", lambda w, d: T(w, d, "--nproc", "3"), r"global batch 8"),
    Case("train-nproc-layout", lambda w, d: T(w, d, "--nproc", "3", "--parallel.tp=2"), r"world size 3|parallel"),
    # generate
    Case("generate-no-args", lambda w, d: ["generate"], r"--checkpoint"),
    Case("generate-missing", lambda w, d: ["generate", "--checkpoint", str(d / "gone")], r"gone"),
    Case("generate-pickle-file", lambda w, d: ["generate", "--checkpoint", str(d / "m.pt")], r"pickle",
         prep=write("m.pt", binary=b"\x80\x04\x95\x00")),
    Case("generate-empty-dir", lambda w, d: ["generate", "--checkpoint", str(d)], re.escape("no checkpoint found")),
    Case("generate-tokens-negative", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--tokens", "-5"],
         r"--tokens"),
    Case("generate-tokens-not-int", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--tokens", "abc"],
         r"--tokens"),
    Case("generate-temperature-nan", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--temperature", "nan"],
         r"--temperature"),
    Case("generate-temperature-negative",
         lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--temperature", "-1"], r"--temperature"),
    Case("generate-top-k-negative", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--top-k", "-3"],
         r"--top-k"),
    Case("generate-seed-negative", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--seed", "-1"], r"--seed"),
    Case("generate-prompt-empty", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--prompt", ""],
         r"--prompt"),
    Case("generate-unknown-flag", lambda w, d: ["generate", "--checkpoint", str(w["run"]), "--bogus"], r"--bogus"),
    Case("generate-corrupt", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))], r"SHA-256", prep=flip_byte),
    Case("generate-evil-metadata", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))],
         r"refused to read checkpoint metadata", prep=evil_metadata, absent=("pwned",)),
    Case("generate-garbage-metadata", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))],
         r"\.metadata", prep=both(copy_ckpt, lambda w, d: _garbage_metadata(ckpt(d)))),
    Case("generate-recorded-shape-disagrees", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))], r"shape",
         prep=edit_state(**{"model.dim": 128})),
    Case("generate-state-config-invalid", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))],
         r"train_state\.json.*optimizer\.lr", prep=lambda w, d: _bad_recorded_lr(w, d)),
    Case("generate-state-kind-unknown", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))], r"'kind'",
         prep=edit_state(kind="lora")),
    # export
    Case("export-no-args", lambda w, d: ["export"], r"--checkpoint|--to|out"),
    Case("export-bad-format", lambda w, d: ["export", "--checkpoint", str(w["run"]), "--to", "onnx", str(d / "o")],
         r"--to"),
    Case("export-bad-dtype", lambda w, d: ["export", "--checkpoint", str(w["run"]), "--to", "hf", "--dtype", "int4",
                                           str(d / "o")], r"--dtype"),
    Case("export-missing-checkpoint", lambda w, d: ["export", "--checkpoint", str(d / "gone"), "--to", "hf",
                                                    str(d / "o")], r"gone"),
    Case("export-out-exists", lambda w, d: ["export", "--checkpoint", str(w["run"]), "--to", "safetensors",
                                            str(d / "keep.safetensors")], r"keep\.safetensors",
         prep=write("keep.safetensors", "precious")),
    Case("export-out-dir-not-empty", lambda w, d: ["export", "--checkpoint", str(w["run"]), "--to", "hf",
                                                   str(d / "hfout")], r"hfout", prep=write("hfout/notes.txt", "mine")),
    Case("export-out-under-file", lambda w, d: ["export", "--checkpoint", str(w["run"]), "--to", "safetensors",
                                                str(d / "file" / "m.safetensors")], r"file", prep=write("file", "x")),
    Case("export-corrupt", lambda w, d: ["export", "--checkpoint", str(ckpt(d)), "--to", "safetensors",
                                         str(d / "m.safetensors")], r"SHA-256", prep=flip_byte, absent=("m.safetensors",)),
    # import
    Case("import-no-args", lambda w, d: ["import"], r"--from|src"),
    Case("import-bad-format", lambda w, d: ["import", "--from", "gguf", str(d)], r"--from"),
    Case("import-missing", lambda w, d: ["import", "--from", "hf", str(d / "gone"), "--out", str(d / "o")], r"gone",
         absent=("o",)),
    Case("import-src-is-file", lambda w, d: ["import", "--from", "hf", str(d / "f"), "--out", str(d / "o")], r"/f\b",
         prep=write("f", "x"), absent=("o",)),
    Case("import-no-config", lambda w, d: ["import", "--from", "hf", str(d), "--out", str(d / "o")], r"config\.json",
         absent=("o",)),
    Case("import-config-not-json", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"config\.json", prep=hf_with(extra=lambda hf: (hf / "config.json").write_text("{bad")), absent=("o",)),
    Case("import-config-a-list", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"config\.json", prep=hf_with(extra=lambda hf: (hf / "config.json").write_text("[1, 2]")), absent=("o",)),
    Case("import-model-type", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"model_type", prep=hf_with({"model_type": "gpt2"}), absent=("o",)),
    Case("import-hidden-size-string", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"hidden_size", prep=hf_with({"hidden_size": "64"}), absent=("o",)),
    Case("import-layers-negative", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"num_hidden_layers", prep=hf_with({"num_hidden_layers": -1}), absent=("o",)),
    Case("import-eps-nan", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"rms_norm_eps", prep=hf_with({"rms_norm_eps": float("nan")}), absent=("o",)),
    Case("import-tie-not-bool", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"tie_word_embeddings", prep=hf_with({"tie_word_embeddings": "yes"}), absent=("o",)),
    Case("import-no-vocab", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"vocab_size", prep=hf_with(drop=["vocab_size"]), absent=("o",)),
    Case("import-rope-scaling", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"RoPE scaling", prep=hf_with({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), absent=("o",)),
    Case("import-biases", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"attention_bias", prep=hf_with({"attention_bias": True}), absent=("o",)),
    Case("import-shape-mismatch", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"shape|intermediate_size|tensor", prep=hf_with({"intermediate_size": 96}), absent=("o",)),
    Case("import-pickle-only", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"pytorch_model\.bin", prep=hf_with(extra=pickle_only), absent=("o",)),
    Case("import-index-traversal", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"etc/passwd", prep=hf_with(extra=traversal_index), absent=("o",)),
    Case("import-garbage-weights", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"model\.safetensors", prep=hf_with(extra=garbage_weights), absent=("o",)),
    Case("import-out-exists", lambda w, d: ["import", "--from", "hf", str(w["hf"]), "--out",
                                            str(w["run"] / "checkpoints")], r"already holds checkpoints",
         prep=lambda w, d: None, extra_roots=("run",)),
    Case("import-out-under-file", lambda w, d: ["import", "--from", "hf", str(w["hf"]), "--out", str(d / "f" / "o")],
         r"--out", prep=write("f", "x")),
    # goodput
    Case("dryrun-rank-outside-world", lambda w, d: ["dryrun", "--world", "4", "--rank", "4"], r"--rank"),
    Case("dryrun-batch-not-split", lambda w, d: ["dryrun", "--world", "64"], r"train\.global_batch"),
    Case("goodput-gpus-zero", lambda w, d: ["goodput", *GOOD_GOODPUT[2:], "--gpus", "0"], r"--gpus"),
    Case("goodput-mtbf-nan", lambda w, d: ["goodput", *GOOD_GOODPUT[:2], "--mtbf-gpu-hours", "nan",
                                           *GOOD_GOODPUT[4:]], r"--mtbf-gpu-hours"),
    Case("goodput-mtbf-inf", lambda w, d: ["goodput", *GOOD_GOODPUT[:2], "--mtbf-gpu-hours", "inf",
                                           *GOOD_GOODPUT[4:]], r"--mtbf-gpu-hours"),
    Case("goodput-days-inf", lambda w, d: ["goodput", *GOOD_GOODPUT, "--days", "inf"], r"--days"),
    Case("goodput-days-huge", lambda w, d: ["goodput", *GOOD_GOODPUT, "--days", "1e9"], r"--days"),
    Case("goodput-trials-zero", lambda w, d: ["goodput", *GOOD_GOODPUT, "--trials", "0"], r"--trials"),
    Case("goodput-trials-huge", lambda w, d: ["goodput", *GOOD_GOODPUT, "--trials", "100000000"], r"--trials"),
    Case("goodput-ckpt-not-duration", lambda w, d: ["goodput", *GOOD_GOODPUT[:4], "--ckpt-save", "soon",
                                                    *GOOD_GOODPUT[6:]], r"soon"),
    Case("goodput-restart-negative", lambda w, d: ["goodput", *GOOD_GOODPUT[:6], "--restart", "-5m"], r"-5m|--restart"),
    Case("goodput-missing-args", lambda w, d: ["goodput", "--gpus", "8"], r"--mtbf-gpu-hours|required"),
    # goodput pricing an exclusion (docs/self-healing.md)
    Case("goodput-exclusion-half-given", lambda w, d: ["goodput", *GOOD_GOODPUT, "--straggler", "0.3", "--hosts", "128"],
         r"--exclude-cost"),
    Case("goodput-exclusion-sum-and-phase", lambda w, d: ["goodput", *GOOD_GOODPUT, "--straggler", "0.3", "--hosts",
                                                          "128", "--exclude-cost", "40s", "--exclude-save", "1s"],
         r"--exclude-save"),
    Case("goodput-exclusion-phase-negative", lambda w, d: ["goodput", *GOOD_GOODPUT, "--straggler", "0.3", "--hosts",
                                                           "128", "--exclude-save=-3s"], r"-3s|--exclude-save"),
    Case("goodput-exclusion-costs-missing", lambda w, d: ["goodput", *GOOD_GOODPUT, "--straggler", "0.3", "--hosts",
                                                          "128", "--exclusion-costs", str(d / "nope")], r"nope"),
    Case("goodput-exclusion-costs-no-exclusion", lambda w, d: ["goodput", *GOOD_GOODPUT, "--straggler", "0.3",
                                                               "--hosts", "128", "--exclusion-costs", str(w["run"])],
         r"--exclusion-costs"),
    # calibrate (every case fails before any measurement)
    Case("calibrate-worlds-not-int", lambda w, d: ["calibrate", "--worlds", "a", "--out", str(d / "p.json")],
         r"--worlds"),
    Case("calibrate-worlds-one", lambda w, d: ["calibrate", "--worlds", "1", "--out", str(d / "p.json")], r"--worlds"),
    Case("calibrate-worlds-huge", lambda w, d: ["calibrate", "--worlds", "1000", "--out", str(d / "p.json")],
         r"--worlds"),
    Case("calibrate-out-under-file", lambda w, d: ["calibrate", "--quick", "--out", str(d / "f" / "p.json")],
         r"--out", prep=write("f", "x")),
    Case("calibrate-out-is-dir", lambda w, d: ["calibrate", "--quick", "--out", str(d)], r"--out"),
    # pipeline-report
    Case("pipeline-pp-one", lambda w, d: ["pipeline-report", "--simulate", "--pp", "1"], r"--pp"),
    Case("pipeline-pp-huge", lambda w, d: ["pipeline-report", "--simulate", "--pp", "100000"], r"--pp"),
    Case("pipeline-microbatches-zero", lambda w, d: ["pipeline-report", "--simulate", "--microbatches", "0"],
         r"--microbatches"),
    Case("pipeline-cost-nan", lambda w, d: ["pipeline-report", "--simulate", "--f", "nan"], r"--f"),
    Case("pipeline-w-above-b", lambda w, d: ["pipeline-report", "--simulate", "--w", "3"], r"W <= B|--w"),
    Case("pipeline-schedule-unknown", lambda w, d: ["pipeline-report", "--simulate", "--schedule", "nope"],
         r"nope"),
    Case("pipeline-out-is-dir", lambda w, d: ["pipeline-report", "--simulate", "--out", str(d)], r"--out"),
    Case("pipeline-json-under-file", lambda w, d: ["pipeline-report", "--nproc", "2", "--json", str(d / "f" / "t.json")],
         r"--json", prep=write("f", "x")),
    Case("pipeline-measure-nproc-one", lambda w, d: ["pipeline-report", "--nproc", "1"], r"--nproc"),
    Case("pipeline-measure-steps-one", lambda w, d: ["pipeline-report", "--nproc", "2", "--steps", "1"], r"--steps"),
    # plan
    Case("plan-gpus-zero", lambda w, d: [*PLAN, "--gpus", "0"], r"--gpus"),
    Case("plan-gpus-missing", lambda w, d: ["plan", "--model", "llama3-8b", "--global-batch", "8"], r"--gpus"),
    Case("plan-model-unknown", lambda w, d: [*PLAN, "--model", "nope"], r"nope"),
    Case("plan-global-batch-zero", lambda w, d: [*PLAN, "--global-batch", "0"], r"--global-batch"),
    Case("plan-seq-zero", lambda w, d: [*PLAN, "--seq", "0"], r"--seq"),
    Case("plan-top-zero", lambda w, d: [*PLAN, "--top", "0"], r"--top"),
    Case("plan-profile-missing", lambda w, d: [*PLAN, "--gpu", "this-machine", "--profile", str(d / "hw.json")],
         r"hw\.json"),
    Case("plan-layout-garbage", lambda w, d: [*PLAN, "--layout", "tp=x"], r"--layout"),
    Case("plan-mb-zero", lambda w, d: [*PLAN, "--mb", "0,2"], r"--mb"),
    Case("plan-fix-unknown", lambda w, d: [*PLAN, "--fix", "foo=1"], r"--fix"),
    Case("plan-precision-unknown", lambda w, d: [*PLAN, "--precision", "fp4"], r"--precision"),
    Case("plan-tokens-garbage", lambda w, d: [*PLAN, "--tokens", "lots"], r"lots"),
    # config: `show` runs the same checks as train, `check --world N` the layout's rules for a world
    Case("config-bad-action", lambda w, d: ["config", "nope"], r"nope"),
    Case("config-lr-nan", lambda w, d: ["config", "show", "--optimizer.lr=nan"], r"optimizer\.lr"),
    Case("config-missing-file", lambda w, d: ["config", "show", "--config", str(d / "c.toml")], r"c\.toml"),
    Case("config-degree-zero", lambda w, d: ["config", "show", "--parallel.tp=0"], r"parallel\.tp"),
    Case("config-zero-2-old-meaning", lambda w, d: ["config", "show", "--parallel.zero=2"], r"parallel\.zero"),
    Case("config-zero-4", lambda w, d: ["config", "show", "--parallel.zero=4"], r"parallel\.zero"),
    Case("config-mixed-precision-unknown", lambda w, d: ["config", "show", "--parallel.mixed_precision=fp9"],
         r"parallel\.mixed_precision"),
    Case("config-schedule-unknown-pp1", lambda w, d: ["config", "show", "--parallel.pp_schedule=Nope"],
         r"parallel\.pp_schedule"),
    Case("config-two-degrees-minus-one", lambda w, d: ["config", "check", "--world", "2", "--parallel.tp=-1",
                                                       "--parallel.dp_shard=-1"], r"parallel.*-1"),
    Case("config-degree-minus-two", lambda w, d: ["config", "show", "--parallel.cp=-2"], r"parallel\.cp"),
    Case("config-check-no-world", lambda w, d: ["config", "check"], r"--world"),
    Case("config-check-world-zero", lambda w, d: ["config", "check", "--world", "0"], r"--world"),
    Case("config-check-world-not-int", lambda w, d: ["config", "check", "--world", "x"], r"--world"),
    Case("config-check-tp-vocab", lambda w, d: ["config", "check", "--world", "4", "--parallel.tp=3"],
         r"parallel\.tp"),
    Case("config-check-degrees-vs-world", lambda w, d: ["config", "check", "--world", "4", "--parallel.tp=2",
                                                        "--parallel.dp_shard=4"], r"world size is 4"),
    Case("config-check-global-batch", lambda w, d: ["config", "check", "--world", "3", "--train.global_batch=8"],
         r"train\.global_batch"),
    # verify: one layout per argument; every layout checked before any rank starts
    Case("verify-no-layouts", lambda w, d: ["verify"], r"layout"),
    Case("verify-empty-layout", lambda w, d: ["verify", "--layouts", ""], r"layout"),
    Case("verify-steps-not-int", lambda w, d: ["verify", "--layouts", "dp_shard=2", "--steps", "x"], r"--steps"),
    Case("verify-steps-zero", lambda w, d: ["verify", "--layouts", "dp_shard=2", "--steps", "0"], r"--steps"),
    Case("verify-tol-loss-nan", lambda w, d: ["verify", "--layouts", "dp_shard=2", "--tol-loss", "nan"],
         r"--tol-loss"),
    Case("verify-tol-weight-negative", lambda w, d: ["verify", "--layouts", "dp_shard=2", "--tol-weight", "-1"],
         r"--tol-weight"),
    Case("verify-config-missing", lambda w, d: ["verify", "--layouts", "dp_shard=2", "--config", str(d / "c.toml")],
         r"c\.toml"),
    Case("verify-layout-not-int", lambda w, d: ["verify", "--layouts", "tp=x"], r"tp='x'"),
    Case("verify-layout-unknown-key", lambda w, d: ["verify", "--layouts", "nope=2"], r"nope"),
    Case("verify-second-layout-bad", lambda w, d: ["verify", "--layouts", "dp_shard=2", "tp=2,dp_shard="],
         r"dp_shard"),
    Case("verify-tp-heads", lambda w, d: ["verify", "--layouts", "tp=3", f"--data.path={w['corpus']}"],
         r"parallel\.tp"),
    Case("verify-schedule-unknown", lambda w, d: ["verify", "--layouts", "pp=2,pp_schedule=Nope",
                                                  f"--data.path={w['corpus']}"], r"Nope"),
    Case("verify-zero-2-with-pp", lambda w, d: ["verify", "--layouts", "dp_shard=2,zero=2,pp=2",
                                                f"--data.path={w['corpus']}"], r"parallel\.zero"),
    Case("verify-global-batch-split", lambda w, d: ["verify", "--layouts", "dp_shard=2", f"--data.path={w['corpus']}",
                                                    "--train.global_batch=3"], r"train\.global_batch"),
    # report
    Case("report-no-args", lambda w, d: ["report"], r"RUN_DIR"),
    Case("report-missing", lambda w, d: ["report", str(d / "gone"), "--out", str(d / "r.html")], r"gone",
         absent=("r.html", "r-*.png")),
    Case("report-not-a-run", lambda w, d: ["report", str(d), "--out", str(d / "r.html")], r"not a run directory",
         absent=("r.html", "r-*.png")),
    Case("report-out-not-html", lambda w, d: ["report", str(w["run"]), "--out", str(d)], r"--out"),
    Case("report-out-under-file", lambda w, d: ["report", str(w["run"]), "--out", str(d / "f" / "r.html")],
         r"--out.*is a file", prep=write("f", "x")),
    Case("report-out-is-users-file", lambda w, d: ["report", str(w["run"]), "--out", str(d / "notes.html")],
         r"--out.*notes\.html", prep=write("notes.html", "<p>mine</p>")),
    Case("report-loss-is-a-string", lambda w, d: ["report", str(d / "bad"), "--out", str(d / "r.html")],
         r"bad/metrics\.jsonl, line 2: 'loss' is 'abc', not a number", absent=("r.html", "r-*.png"),
         prep=write("bad/metrics.jsonl", '{"step": 1, "loss": 5.0, "time": 1.0}\n{"step": 2, "loss": "abc", "time": 2.0}\n')),
    Case("report-keeps-users-figure", lambda w, d: ["report", str(w["run"]), "--out", str(d / "myrep.html")],
         r"myrep-loss\.png exists and is not a figure of the report", prep=write("myrep-loss.png", "my own picture"),
         absent=("myrep.html", "myrep-[!l]*.png", ".myrep*")),
    # prepare (sharded corpora: built in a hidden sibling and renamed; a failure leaves nothing)
    Case("prepare-no-out", lambda w, d: ["prepare"], r"--out"),
    Case("prepare-val-fraction", lambda w, d: ["prepare", "--out", str(d / "p"), "--val-fraction", "2"],
         r"val.fraction"),
    Case("prepare-max-mb-negative", lambda w, d: ["prepare", "--out", str(d / "p"), "--max-mb", "-1"], r"max.mb"),
    Case("prepare-tokenizer-unknown", lambda w, d: ["prepare", "--out", str(d / "p"), "--tokenizer", "words"],
         r"--tokenizer"),
    Case("prepare-vocab-not-int", lambda w, d: ["prepare", "--out", str(d / "p"), "--vocab-size", "big"],
         r"--vocab-size"),
    Case("prepare-workers-zero", lambda w, d: ["prepare", str(d / "a.txt"), "--out", str(d / "p"), "--workers", "0"],
         r"--workers", prep=write("a.txt", "hello"), absent=("p", ".p.*")),
    Case("prepare-shard-mb-zero", lambda w, d: ["prepare", str(d / "a.txt"), "--out", str(d / "p"), "--shard-mb", "0"],
         r"--shard-mb", prep=write("a.txt", "hello"), absent=("p", ".p.*")),
    Case("prepare-jsonl-field-not-text", lambda w, d: ["prepare", str(d / "b.jsonl"), "--out", str(d / "p")],
         r"b\.jsonl:1", prep=write("b.jsonl", '{"text": 1}\n'), absent=("p", ".p.*")),
    Case("prepare-jsonl-not-json", lambda w, d: ["prepare", str(d / "c.jsonl"), "--out", str(d / "p")],
         r"c\.jsonl:2", prep=write("c.jsonl", '{"text": "fine"}\nnot json\n'), absent=("p", ".p.*")),
    Case("prepare-parquet-garbage", lambda w, d: ["prepare", str(d / "d.parquet"), "--out", str(d / "p")],
         r"d\.parquet", prep=write("d.parquet", "xx"), absent=("p", ".p.*")),
    Case("prepare-glob-no-match", lambda w, d: ["prepare", str(d / "nomatch*.txt"), "--out", str(d / "p")],
         r"nomatch", absent=("p", ".p.*")),
    Case("prepare-out-is-file", lambda w, d: ["prepare", str(d / "a.txt"), "--out", str(d / "a.txt")],
         r"a\.txt", prep=write("a.txt", "hello"), absent=(".a.txt.*",)),
    Case("prepare-bad-source-keeps-corpus", lambda w, d: ["prepare", str(d / "good.jsonl"), str(d / "c.jsonl"),
                                                          "--out", str(d / "corpus")],
         r"c\.jsonl", prep=both(write("good.jsonl", '{"text": "a first document"}\n'),
                                 write("c.jsonl", '{"text": "fine"}\nnot json\n'), small_corpus),
         absent=(".corpus.*",)),
    Case("prepare-keeps-existing-corpus", lambda w, d: ["prepare", str(d / "nosuch.txt"), "--out", str(w["corpus"])],
         r"nosuch\.txt|corpus|stdlib"),
    # the dispatcher
    Case("unknown-command", lambda w, d: ["trian"], r"trian"),
]


def _garbage_metadata(ckpt_dir: Path) -> None:
    from ndtrain.train.checkpoint import write_manifest

    (ckpt_dir / ".metadata").write_bytes(b"\x80\x04garbage")
    write_manifest(ckpt_dir)


def _bad_recorded_lr(w, d) -> None:
    from ndtrain.train.checkpoint import write_manifest

    dst = copy_ckpt(w, d)
    state = json.loads((dst / "train_state.json").read_text())
    state["config"]["optimizer"]["lr"] = -1.0
    (dst / "train_state.json").write_text(json.dumps(state))
    write_manifest(dst)


# ---- issue 33, classes 1, 5, 6: a run writes only its own files, never through a link, and what
# ndtrain derives from a name stays inside its parent --------------------------------------------
def _link(rel, target, hard=False):
    """case_dir/rel made a link to case_dir/target, which holds the user's bytes."""
    def prep(w, d):
        (d / target).parent.mkdir(parents=True, exist_ok=True)
        if not (d / target).exists():
            (d / target).write_text("the user's own bytes\n")
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(d / target, d / rel) if hard else (d / rel).symlink_to(d / target)
    return prep


def _copy_run(w, d):
    shutil.copytree(w["run"], d / "out")


def _no_output_dir(w, d, *more):
    return [a for a in T(w, d) if not a.startswith("--train.output_dir")] + list(more)


RUN_FILE_CASES = [
    # class 1: a file of a run file's name that no run made is the user's
    Case("train-output-dir-holds-the-config", lambda w, d: T(w, d, "--config", str(d / "config.toml"),
                                                               f"--train.output_dir={d}"),
         r"config\.toml exists and no ndtrain run made it", prep=write("config.toml", "[train]\nsteps = 2\n"),
         absent=(".ndtrain*", "metrics.jsonl", "checkpoints")),
    Case("train-overwrite-users-metrics", lambda w, d: T(w, d, "--train.overwrite=true"),
         r"out/metrics\.jsonl exists and no ndtrain run made it", prep=write("out/metrics.jsonl", '{"mine": 1}\n'),
         absent=("out.replaced-*", "out/.ndtrain*")),
    Case("train-users-checkpoints-dir", lambda w, d: T(w, d), r"out/checkpoints exists and no ndtrain run made it",
         prep=write("out/checkpoints/notes.txt", "mine"), absent=("out/checkpoints/step_*", "out/.ndtrain*")),
    # class 5: a run entry that is a link is refused, never written through
    Case("train-lock-symlink", lambda w, d: T(w, d), r"\.ndtrain\.lock is a symbolic link",
         prep=_link("out/.ndtrain.lock", "victim.txt")),
    Case("train-lock-hard-link", lambda w, d: T(w, d), r"\.ndtrain\.lock is not a regular file of its own",
         prep=_link("out/.ndtrain.lock", "victim.txt", hard=True)),
    Case("train-config-symlink-in-own-run", lambda w, d: T(w, d, "--checkpoint.resume=auto", "--train.steps=5"),
         r"out/config\.toml is a symbolic link", prep=both(_copy_run, lambda w, d: (d / "out" / "config.toml").unlink(),
                                                          _link("out/config.toml", "victim.toml"))),
    Case("train-metrics-symlink", lambda w, d: T(w, d, "--checkpoint.resume=auto"), r"metrics\.jsonl is a symbolic link",
         prep=_link("out/metrics.jsonl", "victim.txt")),
    Case("train-checkpoints-symlink", lambda w, d: T(w, d), r"out/checkpoints is a symbolic link.*--checkpoint\.dir",
         prep=both(write("elsewhere/notes.txt", "mine"), lambda w, d: (d / "out").mkdir(),
                   lambda w, d: (d / "out" / "checkpoints").symlink_to(d / "elsewhere")),
         absent=("elsewhere/step_*", "elsewhere/.step_*")),
    # class 6: runs/<name>-<time> stays inside runs/
    Case("train-name-escapes-runs", lambda w, d: _no_output_dir(w, d, "--config", str(d / "c.toml")), r"'name'",
         prep=write("c.toml", 'name = "../../escaped"\n'), absent=("escaped-*", "runs")),
    Case("train-name-absolute", lambda w, d: _no_output_dir(w, d, "--config", str(d / "c.toml")), r"'name'",
         prep=lambda w, d: write("c.toml", f'name = "{d / "abs"}"\n')(w, d), absent=("abs-*", "runs")),
    Case("config-name-nested", lambda w, d: ["config", "show", "--config", str(d / "c.toml")], r"'name'.*plain name",
         prep=write("c.toml", 'name = "a/b"\n')),
    Case("train-mix-name-escapes", lambda w, d: T(w, d, '--data.mix=[["../x", 1]]'), r"data\.mix.*plain name"),
]
CASES += RUN_FILE_CASES


# ---- issue 33, classes 7 and 9: the validation split's record, its size, and what generation reads ---
def _corpus_with(edit):
    """case_dir/data: a copy of the suite's corpus with its manifest edited by `edit`."""
    def prep(w, d):
        shutil.copytree(w["corpus"], d / "data")
        path = d / "data" / "manifest.json"
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))
    return prep


def _bpe_run_without_its_data(w, d):
    """A checkpoint of a BPE run whose corpus (and so its tokenizer.json) is gone."""
    from ndtrain.train.checkpoint import write_manifest

    dst = copy_ckpt(w, d)
    state = json.loads((dst / "train_state.json").read_text())
    state["data"] = {**state["data"], "tokenizer": "bpe"}
    state["config"]["data"]["path"] = str(d / "gone")
    (dst / "train_state.json").write_text(json.dumps(state))
    write_manifest(dst)


def D(w, d, *more):
    """T() on case_dir/data."""
    return [a if not a.startswith("--data.path=") else f"--data.path={d / 'data'}" for a in T(w, d, *more)]


SPLIT_CASES = [
    Case("train-data-val-split-not-a-table", lambda w, d: D(w, d), r"parts\[0\]\.val_split",
         prep=_corpus_with(lambda m: m["parts"][0].__setitem__("val_split", "drawn"))),
    Case("train-data-val-split-documents-negative", lambda w, d: D(w, d), r"parts\[0\]\.val_split\.documents",
         prep=_corpus_with(lambda m: m["parts"][0]["val_split"].__setitem__("documents", -3))),
    Case("train-val-batch-size-zero", lambda w, d: T(w, d, "--train.val_batch_size=0"), r"train\.val_batch_size"),
    Case("train-val-batch-size-beyond-the-split", lambda w, d: T(w, d, "--train.val_interval=1",
                                                                 "--train.val_batch_size=1000000"),
         r"train\.val_batches.*train\.val_batch_size"),
    Case("generate-bpe-run-without-its-data", lambda w, d: ["generate", "--checkpoint", str(ckpt(d))],
         r"bpe tokenizer.*holds no tokenizer\.json.*data\.path .*gone", prep=_bpe_run_without_its_data),
    Case("export-hf-bpe-run-without-its-data",
         lambda w, d: ["export", "--checkpoint", str(ckpt(d)), "--to", "hf", str(d / "hf-out")],
         r"bpe tokenizer.*holds no tokenizer\.json.*data\.path .*gone", prep=_bpe_run_without_its_data),
]
CASES += SPLIT_CASES


# ---- issue 33, classes 2, 3, 4, 10: a checkpoints directory is one live run's, clean-up touches only
# ndtrain's own names, a resume that finds nothing usable stops, and no resume changes the model ---------
def _ckpt_run(corrupt=False, user_dirs=False):
    """case_dir/out: a run directory whose checkpoints/ holds the shared run's step 4 (its one
    checkpoint: damaged when `corrupt`), beside directories of the user's when `user_dirs`."""
    def prep(w, d):
        dst = d / "out" / "checkpoints" / w["ckpt"].name
        shutil.copytree(w["ckpt"], dst)
        if corrupt:
            shard = dst / "__0_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        if user_dirs:  # names like ndtrain's leftovers, none of them its own
            for rel in ("photos.partial/cat.jpg", ".step_00000009.partial/notes.txt", "old.deleting/a.txt",
                        ".abandoning-from-mine/b.txt"):
                (d / "out" / "checkpoints" / rel).parent.mkdir(parents=True)
                (d / "out" / "checkpoints" / rel).write_text("the user's own bytes\n")
    return prep


CHECKPOINT_DIR_CASES = [
    # class 2: a live run's checkpoint.dir is locked like its output_dir
    Case("train-checkpoint-dir-locked", lambda w, d: T(w, d, f"--checkpoint.dir={d / 'ck'}"),
         r"ck is in use by a live run.*checkpoint\.dir", lock="ck", absent=("ck/step_*", "ck/.step_*")),
    # class 4: resume=auto whose only checkpoint is damaged stops, and moves nothing
    Case("train-resume-auto-only-checkpoint-corrupt", lambda w, d: T(w, d, "--checkpoint.resume=auto"),
         r"no usable checkpoint under .*out/checkpoints.*SHA-256.*--train\.overwrite=true",
         prep=_ckpt_run(corrupt=True), absent=("out/checkpoints/corrupt", "out/checkpoints/step_00000002")),
    # classes 10 and 3: a semantic change is refused (resume=auto), after start-up clean-up left the user's
    # directories of leftover-like names alone
    Case("train-resume-auto-other-rope-theta", lambda w, d: T(w, d, "--checkpoint.resume=auto",
                                                                "--model.rope_theta=500000"),
         r"model\.rope_theta=10000\.0 but this run has 500000\.0.*allow_model_change", prep=_ckpt_run(user_dirs=True)),
    Case("train-resume-other-norm-eps-and-theta", lambda w, d: T(w, d, f"--checkpoint.resume={w['ckpt']}",
                                                                   "--model.norm_eps=1e-6", "--model.rope_theta=20000"),
         r"model\.rope_theta=.*model\.norm_eps="),
    Case("train-allow-model-change-shape-key", lambda w, d: T(w, d, '--checkpoint.allow_model_change=["dim"]'),
         r"checkpoint\.allow_model_change.*may list only rope_theta"),
]
CASES += CHECKPOINT_DIR_CASES


# ---- issue 33, classes 11 and 14: import checks config.json against the safetensors headers before
# it allocates anything; the launcher's variables, malformed or left over without a launcher -------
_MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
HEADER_AND_ENV_CASES = [
    # before: 25.6 GB allocated for a 1e8-token embedding; a hang building 1e7 layers
    Case("import-vocab-huge", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"vocab_size", prep=hf_with({"vocab_size": 100_000_000}), absent=("o",)),
    Case("import-layers-huge", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"num_hidden_layers", prep=hf_with({"num_hidden_layers": 10_000_000}), absent=("o",)),
    Case("import-ffn-huge", lambda w, d: ["import", "--from", "hf", str(d / "hf"), "--out", str(d / "o")],
         r"intermediate_size", prep=hf_with({"intermediate_size": 50_000_000}), absent=("o",)),
    # before: torch's traceback (env:// rendezvous), or int()'s
    Case("train-env-world-size-not-int", lambda w, d: T(w, d), r"WORLD_SIZE='two'", env={"WORLD_SIZE": "two"},
         absent=("out",)),
    Case("train-env-rank-beyond-world", lambda w, d: T(w, d), r"RANK=5 must be below WORLD_SIZE=2",
         env={"WORLD_SIZE": "2", "RANK": "5", **_MASTER}, absent=("out",)),
    Case("train-env-left-over-without-launcher", lambda w, d: T(w, d), r"WORLD_SIZE=2 is set but MASTER_ADDR",
         env={"WORLD_SIZE": "2", "RANK": "0"}, absent=("out",)),
    Case("train-env-master-port-garbage", lambda w, d: T(w, d), r"MASTER_PORT='http'",
         env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, absent=("out",)),
    Case("train-env-local-rank-garbage", lambda w, d: T(w, d), r"LOCAL_RANK='-1'", env={"LOCAL_RANK": "-1"},
         absent=("out",)),
]
CASES += HEADER_AND_ENV_CASES


# ---- running them ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(corpus_dir, tmp_path_factory, hang_deadline):
    from ndtrain.config import load_config
    from ndtrain.tools.interop import export
    from ndtrain.train.rundir import RunLock
    from ndtrain.train.trainer import train

    base = tmp_path_factory.mktemp("bad-input")
    run = base / "run"
    train(load_config(None, {"data": {"path": str(corpus_dir), "seq_len": 64},
                             "train": {"steps": 4, "global_batch": 8, "micro_batch": 8, "val_interval": 0,
                                       "sample_tokens": 0, "output_dir": str(run)},
                             "checkpoint": {"interval_steps": 2, "keep_last": 3},
                             "logging": {"tensorboard": False, "progress": "off"}}))
    world = {"base": base, "corpus": corpus_dir, "run": run, "ckpt": run / "checkpoints" / "step_00000004",
             "hf": base / "hf"}
    export(run, "hf", world["hf"])
    shared = {"corpus": corpus_dir, "run": run, "hf": world["hf"]}
    specs, locks = [], []
    for case in CASES:
        d = base / "cases" / case.id
        d.mkdir(parents=True)
        if case.prep:
            case.prep(world, d)
        if case.lock:
            locks.append(RunLock.acquire(d / (case.lock if isinstance(case.lock, str) else "out")))
        argv = [str(a) for a in case.argv(world, d)]
        roots = [str(d)] + [str(p) for name, p in shared.items()
                            if name in case.extra_roots or any(str(p) in a for a in argv)]
        specs.append({"id": case.id, "argv": argv, "cwd": str(d), "roots": roots, "env": case.env})
    cases_file, results_file = base / "cases.json", base / "results.json"
    cases_file.write_text(json.dumps(specs))
    try:
        proc = subprocess.run([sys.executable, str(RUNNER), str(cases_file), str(results_file)],
                              capture_output=True, text=True, timeout=hang_deadline(900))
    finally:
        for lock in locks:
            lock.release()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results_file.read_text()), base


def test_enough_cases_across_all_subcommands():
    from ndtrain.cli import COMMANDS

    covered = {c.argv({"corpus": "", "run": Path("/r"), "hf": Path("/h"), "ckpt": Path("/c")}, Path("/d"))[0]
               for c in CASES}
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    assert set(COMMANDS) <= covered, set(COMMANDS) - covered


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_clear_line_and_nothing_lost(case, results):
    got, base = results
    r = got[case.id]
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    detail = f"rc={r['rc']}\nstderr:\n{r['stderr']}\nstdout tail:\n{r['stdout'][-600:]}"
    assert r["rc"] == case.rc, detail
    assert len(lines) == 1, detail
    assert "Traceback" not in r["stderr"] + r["stdout"], detail
    assert re.search(case.names, lines[0], re.IGNORECASE), detail
    assert lines[0].startswith("ndtrain"), detail
    assert not r["changed"], f"files changed or removed: {r['changed']}\n{detail}"
    for pattern in case.absent:  # glob patterns: hidden temporaries included
        made = list((base / "cases" / case.id).glob(pattern))
        assert not made, f"{made} created\n{detail}"
