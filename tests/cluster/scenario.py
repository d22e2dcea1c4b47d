"""What several cluster tests share: a layout's config written where every node reads it, the
one-process reference losses, a run of `ndtrain train` across the cluster's nodes, and its rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import agents

_PARITY = Path(__file__).parents[1] / "parallel" / "test_parity.py"


def parity_tolerance() -> float:
    """The fp32 layout-parity tolerance of tests/parallel/test_parity.py (one definition)."""
    spec = importlib.util.spec_from_file_location("_ndtrain_parity_rules", _PARITY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FP32_TOL


def with_data(base: dict, data_path: Path, **train) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    out["data"]["path"] = str(data_path)
    out["train"].update({"val_interval": 0, "sample_tokens": 0, **train})
    return out


def write_config(cluster, base: dict, spec: str, name: str = "train.toml") -> Path:
    """The layout `spec` (verify's syntax: "dp_shard=2,tp=2") over `base`, resolved and written as
    TOML on the shared directory, for the config every node reads."""
    from ndtrain.config import to_toml
    from ndtrain.tools.verify import layout_config

    path = cluster.shared / name
    path.write_text(to_toml(layout_config(base, spec)))
    return path


def reference_losses(base: dict, steps: int) -> list[float]:
    """One process, the same data and seed, in this process."""
    from ndtrain.config import load_config
    from ndtrain.tools.verify import run_steps

    return [float(x) for x in run_steps(load_config(None, base), steps)["losses"]]


def train_across(cluster, config: Path, run_dir: Path, nproc: int, guard_s: float, extra: list[str] = (),
                 nodes=None, run_id: str = "job1", env: dict | None = None, max_restarts: int = 0,
                 pin_cores: bool = False):
    """`ndtrain train --config` under one torchrun agent per node; returns (exit codes by node, Agents)."""
    args = ["--config", str(config), f"--train.output_dir={run_dir}", "--logging.progress=off", *extra]
    started = agents.start_agents(cluster, nproc, args, run_id=run_id, nodes=nodes, env=env,
                                  max_restarts=max_restarts, pin_cores=pin_cores)
    return started.wait(guard_s), started


def metric_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def step_losses(run_dir: Path) -> dict[int, float]:
    """The training loss of each step (event rows, such as start and end, carry no loss)."""
    return {r["step"]: r["loss"] for r in metric_rows(run_dir) if r.get("loss") is not None and "event" not in r}


def samples_by_step(run_dir: Path) -> dict[int, list[int]]:
    """step -> the global sample numbers trained on, from each rank's sample log (tests/train/
    fault_plan.py's, with NDTRAIN_SAMPLE_LOG set); a step trained twice (by two attempts, or by
    two worlds) fails here."""
    by_step: dict[int, list] = {}
    for path in Path(run_dir).glob("samples.rank*.jsonl"):
        rank = int(path.name.split("rank")[1].split(".")[0])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).append((rank, row["world"], row["ids"]))
    out = {}
    for step, got in by_step.items():
        ranks, worlds = sorted(r for r, _, _ in got), {w for _, w, _ in got}
        assert len(worlds) == 1 and ranks == list(range(worlds.pop())), f"step {step} was trained more than once: {got}"
        out[step] = [i for _, _, ids in sorted(got) for i in ids]
    return out
