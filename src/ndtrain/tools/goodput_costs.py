"""`ndtrain goodput`, with --exclusion-costs RUN_DIR: the planner's command (planner/command.py,
which reads no run) given the phases of the exclusions a run directory recorded, as `ndtrain
report` shows them (tools/run_data.membership_phases)."""

from __future__ import annotations

import statistics

from ndtrain.errors import NdtrainError
from ndtrain.planner.command import goodput_main
from ndtrain.tools.run_data import membership_phases, read_run


def measured_exclusion(run_dir: str) -> dict[str, str]:
    """Each phase's median over the run's exclusions (membership changes that took a host out and
    reached steady steps), in seconds, as the planner's --exclude-<phase> flags take them."""
    changes = [p for p in membership_phases(read_run(run_dir)) if p["excluded"] and p["warmup_s"] is not None]
    if not changes:
        raise NdtrainError(f"--exclusion-costs {run_dir}: no exclusion that reached its steady steps in this run's "
                           f"metrics.jsonl (docs/self-healing.md)")
    keys = {"detect": "detection_s", "save": "save_s", "rendezvous": "rendezvous_s", "reshard": "reshard_s",
            "warmup": "warmup_s"}
    out = {}
    for name, key in keys.items():
        values = [p[key] for p in changes if p[key] is not None]
        if values:
            out[name] = f"{max(0.0, statistics.median(values)):.3f}s"
    return out


def main(argv: list[str]) -> int:
    return goodput_main(argv, measured_exclusion)
