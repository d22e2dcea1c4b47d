"""The GPU check on a machine whose Python has only torch: benchmarks/gpu_check.sh installs what
that Python lacks offline from wheelhouse/py<XY>/ (built by scripts/gpu_wheelhouse.sh), into a
folder of the run on PYTHONPATH, leaving the machine's own packages alone."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.sh"
HOUSE_SCRIPT = ROOT / "scripts" / "gpu_wheelhouse.sh"
TAG = f"py{sys.version_info[0]}{sys.version_info[1]}"


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel holding one module `name`."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "WHERE = 'wheelhouse'\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.mark.timeout(300)
def test_the_check_installs_only_what_this_python_lacks_offline(tmp_path, hang_deadline):
    house = tmp_path / "house"
    (house / TAG).mkdir(parents=True)
    _wheel(house / TAG, "ndtrain_probe_pkg", "1.0")
    _wheel(house / TAG, "pydantic", "0.0.1")  # this Python has pydantic: its own must stay
    env = dict(os.environ, OMP_NUM_THREADS="1", PY=sys.executable, GPU_CHECK_WHEELHOUSE=str(house),
               GPU_CHECK_STAGES="env", TMPDIR=str(tmp_path), PIP_NO_INDEX="1",
               GPU_CHECK_BUDGET_SCALE=f"{hang_deadline(1.0):.3f}")
    proc = subprocess.run(["bash", str(CHECK), "--dry-run"], capture_output=True, text=True, timeout=hang_deadline(280),
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wheelhouse: installed 1 wheels offline from {house / TAG} (ndtrain_probe_pkg)" in proc.stdout
    sites = list(tmp_path.glob("ndtrain-gpu-check.*/site"))
    assert len(sites) == 1 and (sites[0] / "ndtrain_probe_pkg" / "__init__.py").is_file()
    assert not (sites[0] / "pydantic").exists()
    assert "| env |" in proc.stdout and "1 stages:" in proc.stdout


def test_the_wheelhouse_script_refuses_bad_arguments_in_one_line(tmp_path, hang_deadline):
    for args, names in ((["--python-version", "3"], "--python-version '3'"), (["--frobnicate"], "'--frobnicate'")):
        proc = subprocess.run(["bash", str(HOUSE_SCRIPT), *args, "--dest", str(tmp_path)], capture_output=True,
                              text=True, timeout=hang_deadline(60))
        assert proc.returncode == 2 and names in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing made


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_torch_only_venv_and_the_wheelhouse_run_the_dry_run(tmp_path, hang_deadline):
    """Builds the wheelhouse for this Python (--bare: numpy too, which the GPU image has but a
    torch-only venv does not) from the package index, makes a venv holding only torch and its own
    requirements, and runs every stage of the check's dry run there: none may fail."""
    house = tmp_path / "house"
    build = subprocess.run(["bash", str(HOUSE_SCRIPT), "--python-version", f"{sys.version_info[0]}.{sys.version_info[1]}",
                            "--bare", "--dest", str(house)], capture_output=True, text=True, timeout=hang_deadline(600))
    assert build.returncode == 0, build.stderr[-2000:]
    size = sum(p.stat().st_size for p in (house / TAG).glob("*.whl"))
    assert size <= 50 << 20
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=hang_deadline(300))
    py = venv / "bin" / "python"
    import torch

    torch_version = torch.__version__.split("+")[0]
    install = subprocess.run([str(py), "-m", "pip", "install", "--quiet", f"torch=={torch_version}"],
                             capture_output=True, text=True, timeout=hang_deadline(900))
    assert install.returncode == 0, install.stderr[-2000:]
    have = subprocess.run([str(py), "-c", "import pydantic"], capture_output=True, text=True)
    assert have.returncode != 0  # the venv really lacks what the check needs
    env = dict(os.environ, OMP_NUM_THREADS="1", PY=str(py), GPU_CHECK_WHEELHOUSE=str(house),
               GPU_CHECK_BUDGET_SCALE=f"{hang_deadline(1.0):.3f}")
    proc = subprocess.run(["bash", str(CHECK), "--dry-run"], capture_output=True, text=True,
                          timeout=hang_deadline(880), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "wheelhouse: installed" in proc.stdout and "10 stages:" in proc.stdout and "0 FAIL" in proc.stdout, proc.stdout
