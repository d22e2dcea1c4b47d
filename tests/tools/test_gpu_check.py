"""The prepared GPU check and the GPU scripts it drives run on CPU (their --dry-run), so none of
them can rot unseen; a stage that cannot run is one line of the table, never the end of the
check; and the container image names the Python and torch that pyproject.toml pins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ["env", "calibrate", "train-eager", "train-compiled", "fp8", "cp-attention", "doc-mask",
          "ac-recompute", "tf32", "ckpt-stall"]


def _table(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("| ") and cells[0] in STAGES:
            rows[cells[0]] = cells
    return rows


def _run(env_extra: dict, *args: str, timeout: int, hang_deadline) -> subprocess.CompletedProcess:
    """The check with its stage budgets (GPU seconds; on CPU, hang guards) and `timeout` scaled by
    this host's measured slowdown (conftest hang_deadline)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GPU_CHECK_BUDGET_SCALE=f"{hang_deadline(1.0):.3f}", **env_extra)
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, timeout=hang_deadline(timeout),
                          env=env)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_dry_run_runs_every_stage_on_cpu(hang_deadline):
    proc = _run({"PY": sys.executable}, "--dry-run", timeout=590, hang_deadline=hang_deadline)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = _table(proc.stdout)
    assert list(rows) == STAGES, proc.stdout
    for stage, (_, result, means, verdict) in rows.items():
        assert verdict in ("pass", "info"), f"{stage}: {result}"
        assert "did not run" not in result and means, f"{stage}: {result}"
    assert "10 stages:" in proc.stdout and "0 FAIL" in proc.stdout


@pytest.mark.timeout(120)
def test_without_a_gpu_each_stage_is_one_line(hang_deadline):
    proc = _run({"PY": sys.executable, "GPU_CHECK_STAGES": "env tf32"}, timeout=110, hang_deadline=hang_deadline)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = _table(proc.stdout)
    assert list(rows) == ["env", "tf32"]
    assert rows["env"][3] == "FAIL" and "no CUDA device" in rows["env"][1]
    assert rows["tf32"][3] == "skip" and "no CUDA device" in rows["tf32"][1]


@pytest.mark.timeout(60)
def test_a_crashing_stage_degrades_to_one_line(tmp_path, hang_deadline):
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \"$1\" in -) exec " + sys.executable + " \"$@\";; esac\n"
                    "echo 'Traceback (most recent call last):' >&2\n"
                    "echo 'ImportError: cannot import name flops_per_token' >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = _run({"PY": str(fake), "GPU_CHECK_STAGES": "env fp8"}, timeout=50, hang_deadline=hang_deadline)
    assert proc.returncode == 0, proc.stderr
    rows = _table(proc.stdout)
    assert list(rows) == ["env", "fp8"]
    for _, result, _, verdict in rows.values():
        assert verdict == "FAIL" and result.startswith("did not run (exit 1)") and "flops_per_token" in result


def test_every_gpu_script_is_driven_by_the_check():
    """A GPU script the check does not run in its dry run (which CI runs: make test-heavy) can rot unseen,
    as gpu_fp8_throughput.py did when flops_per_token moved."""
    driver = (ROOT / "benchmarks" / "gpu_check.py").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("gpu_*.py") if p.name != "gpu_check.py")
    assert scripts, "no GPU scripts found"
    for name in scripts:
        assert f"benchmarks/{name}" in driver, f"{name} is not run by benchmarks/gpu_check.py"
        assert "--dry-run" in (ROOT / "benchmarks" / name).read_text(), f"{name} has no --dry-run"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_names_the_pinned_python_and_torch():
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    project = _pyproject()["project"]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    assert args["TORCH_VERSION"] == torch_pin.split("==")[1]
    lowest = re.fullmatch(r">=\s*(\d+\.\d+)", project["requires-python"].strip())
    assert lowest, f"requires-python {project['requires-python']!r} should be a lower bound"
    assert args["PYTHON_VERSION"] == lowest[1], "the image's Python is the lowest one the project supports"
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}", text, re.M)
    assert 'pip install "torch==${TORCH_VERSION}"' in text and re.search(r"^RUN pip install \.", text, re.M)


def test_kubernetes_examples_run_the_image_the_dockerfile_builds():
    version = _pyproject()["project"]["version"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"docker build -t ndtrain:{version} ." in dockerfile
    for path in sorted((ROOT / "examples" / "kubernetes").glob("*.yaml")):
        for image in re.findall(r"^\s*image:\s*(\S+)", path.read_text(), re.M):
            assert image == f"ndtrain:{version}", f"{path.name}: image {image} is not what the Dockerfile builds"
