"""Every config under configs/ says what it shows and how to run it, its layout is valid for the
world its command starts, and the CPU-sized ones train 5 steps."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ndtrain.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
FAST = {"debug", "moe-ep"}  # the rest train in the slow suite (world 2 and 8 on 2 cores)


def header(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def run_command(path: Path) -> str:
    runs = [line.removeprefix("Run:").strip() for line in header(path) if line.startswith("Run:")]
    assert len(runs) == 1, f"{path.name}: the header needs exactly one 'Run:' line"
    return runs[0]


def world_of(command: str) -> int:
    if m := re.search(r"--nnodes[ =](\d+)\b.*--nproc-per-node[ =](\d+)", command):
        return int(m[1]) * int(m[2])
    m = re.search(r"--nproc[ =](\d+)", command)
    return int(m[1]) if m else 1


def _check_with_dims(config: Path, world: int) -> None:
    from ndtrain.parallel.dims import checked_layout

    cfg = load_config(str(config))
    checked_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, cfg.train)  # the batch rule among the layout's


def _check_with_command(config: Path, world: int, hang_deadline) -> None:
    """`ndtrain config check` (issue 11's layout check): exit 0 when the layout is valid."""
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "config", "check", "--world", str(world),
                           "--config", str(config)], capture_output=True, text=True, timeout=hang_deadline(60))
    assert proc.returncode == 0, proc.stderr


check_layout = _check_with_dims  # becomes _check_with_command once `ndtrain config check` exists


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_config_has_a_header_and_a_valid_layout_for_its_world(config):
    lines = header(config)
    assert len(lines) >= 3 and len(lines[0]) > 20, f"{config.name}: say what it shows in a comment header"
    command = run_command(config)
    assert f"--config configs/{config.name}" in command
    assert command.startswith(("ndtrain train", "torchrun ")), command
    check_layout(config, world_of(command))


def test_gpu_configs_are_checked_for_the_worlds_the_issue_names(hang_deadline):
    worlds = {p.stem: world_of(run_command(p)) for p in CONFIGS}
    assert worlds["llama3-8b-8gpu"] == 8 and worlds["llama3-70b-64gpu"] == 64
    for name in ("moe-ep", "long-context", "pipeline", "3d", "bf16"):
        assert name in worlds
    for p in CONFIGS:  # each GPU-sized config also shows a command that checks it here, without GPUs
        if run_command(p).startswith("torchrun"):
            checks = [line for line in header(p) if line.startswith("Check here: ndtrain plan")]
            assert checks, p.name
            proc = subprocess.run([sys.executable, "-m", "ndtrain", *checks[0].split()[3:]], capture_output=True,
                                  text=True, timeout=hang_deadline(60))
            assert proc.returncode == 0 and "memory" in proc.stdout, proc.stderr
            used, of = map(float, re.search(r"memory ([\d.]+) of ([\d.]+) GiB", proc.stdout).groups())
            assert used < of, proc.stdout  # the planner says it fits


def _train(cfg):
    from ndtrain.train.trainer import train

    return train(cfg)["steps"]


CPU_CONFIGS = [p for p in CONFIGS if run_command(p).startswith("ndtrain train")]


@pytest.mark.parametrize("config", [pytest.param(p, id=p.stem, marks=() if p.stem in FAST else pytest.mark.slow)
                                    for p in CPU_CONFIGS])
@pytest.mark.timeout(600)
def test_cpu_config_trains_5_steps(config, corpus_dir, tmp_path, hang_deadline):
    import json

    from ndtrain.parallel.launch import run_ranks

    world = world_of(run_command(config))
    cfg = load_config(str(config), {
        "data": {"path": str(corpus_dir)},
        # 4 validation sequences: the test corpus holds 4 of long-context's 4,096 tokens
        "train": {"steps": 5, "val_interval": 5, "val_batches": 1, "val_batch_size": 4, "sample_tokens": 0,
                  "output_dir": str(tmp_path)},
        "logging": {"progress": "off", "trackers": []}})
    steps = run_ranks(world, _train, cfg, timeout_s=hang_deadline(300)) if world > 1 else [_train(cfg)]
    assert steps == [5] * world
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    start = next(r for r in rows if r.get("event") == "start")
    assert start["world"] == world
    assert [r["val_loss"] for r in rows if "val_loss" in r][0] < losses[0] + 0.5
