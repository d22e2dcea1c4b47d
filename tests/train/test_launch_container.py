"""Launching where users launch: a container whose first process (PID 1) is the launcher, a
container whose PID 1 is an init, and a GPU node.

- Under `unshare --pid` the launcher is PID 1, as torchrun is in both Kubernetes examples: every
  worker's parent is PID 1, and a worker must not read that as "my launcher died".
- Killing the launcher (SIGKILL: nothing it can forward) still kills its workers.
- A worker whose launcher really is gone says so in one line.
- The CUDA branch of process-group setup (device bound before the group, `device_id` passed) and
  the fp8 compute-capability refusal, run on CPU against a patched torch.cuda.
- pyproject's requires-python covers what the code imports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from chaos import descendants

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _unshare_works(hang_deadline) -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=hang_deadline(30)).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def unshare_pid(hang_deadline):
    """Skips where `unshare --pid` cannot run. A fixture, not a collection-time skipif, so that the
    probe's hang guard scales with the host as every other wait does (conftest hang_deadline), and
    runs only where a test needs it."""
    if not _unshare_works(hang_deadline):
        pytest.skip("unshare --pid needs root (CI runs as root)")


needs_unshare = pytest.mark.usefixtures("unshare_pid")


def _args(corpus: Path, out: Path, steps: int) -> list[str]:
    return ["--config", str(REPO / "configs" / "debug.toml"), f"--data.path={corpus}", "--data.seq_len=64",
            "--train.global_batch=8", "--train.micro_batch=4", f"--train.steps={steps}", "--train.val_interval=0",
            "--train.sample_tokens=0", "--train.log_interval=1", "--logging.tensorboard=false",
            "--logging.progress=off", "--train.timeout_s=60", f"--train.output_dir={out}"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _steps_logged(out: Path) -> list[int]:
    try:
        text = (out / "metrics.jsonl").read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a row half written
            pass
    return [r["step"] for r in rows if "loss" in r]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ---- the launcher is PID 1 ----------------------------------------------------------------------
@needs_unshare
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["torchrun", "ndtrain --nproc"])
def test_workers_of_a_pid_1_launcher_train(launcher, corpus_dir, tmp_path, hang_deadline):
    out = tmp_path / "run"
    if launcher == "torchrun":
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "ndtrain", "train"]
    else:  # its workers are told the launcher's pid (launch_env.LAUNCHER_ENV): 1 here
        cmd = [sys.executable, "-m", "ndtrain", "train", "--nproc", "2"]
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd,
                           *_args(corpus_dir, out, 3)], capture_output=True, text=True, timeout=hang_deadline(200),
                          env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps_logged(out)[-1] == 3


# ---- the launcher dies -------------------------------------------------------------------------
@needs_unshare
@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_under_an_init_leaves_no_worker(corpus_dir, tmp_path, hang_deadline):
    """PID 1 is an init that outlives the launcher (tini, a shell): the workers, reparented to it,
    would train on as orphans if only the namespace's end could stop them."""
    out = tmp_path / "run"
    init = ["sh", "-c", '"$@" & exec sleep 600', "sh"]  # PID 1 stays alive and reaps nothing
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *init, str(TORCHRUN),
                             "--standalone", "--nproc-per-node", "2", "-m", "ndtrain", "train",
                             *_args(corpus_dir, out, 400)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=_env())
    try:
        deadline = time.monotonic() + hang_deadline(180)
        while not _steps_logged(out):
            assert proc.poll() is None and time.monotonic() < deadline, f"no step in time ({proc.poll()})"
            time.sleep(0.1)
        below = descendants(proc.pid)
        agents = [p for p in below if b"torchrun" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(agents) == 1, below
        workers = descendants(agents[0])
        assert len(workers) >= 2, workers
        os.kill(agents[0], signal.SIGKILL)
        # The kernel kills them at once (PR_SET_PDEATHSIG); the wait only stops a test they outlive.
        patience = hang_deadline(10)
        killed = time.monotonic()
        while time.monotonic() - killed < patience and any(_running(p) for p in workers):
            time.sleep(0.05)
        alive = [p for p in workers if _running(p)]
        assert not alive, f"workers still running {patience:.0f} s after their launcher was killed: {alive}"
        assert proc.poll() is None, "PID 1 ended, and with it the namespace: the test proves nothing"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=hang_deadline(30))


@pytest.mark.timeout(60)
def test_a_worker_whose_launcher_is_gone_says_so_in_one_line(hang_deadline):
    gone = 4_194_305  # above the kernel's largest pid: never this process's parent
    code = f"from ndtrain.train.distributed import die_with_parent; die_with_parent({gone}); print('survived')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_deadline(50),
                          env=_env())
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and "survived" not in done.stdout, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and "launcher" in lines[0] and str(gone) in lines[0], done.stderr


@pytest.mark.timeout(60)
def test_a_worker_whose_launcher_is_alive_goes_on(hang_deadline):
    code = f"from ndtrain.train.distributed import die_with_parent; die_with_parent({os.getpid()}); print('survived')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_deadline(50),
                          env=_env())
    assert done.returncode == 0 and done.stdout.strip() == "survived" and not done.stderr.strip(), done.stderr


# ---- process-group setup on a GPU node, run on CPU -----------------------------------------------
def _patched_cuda(monkeypatch, calls: list, devices: int = 4) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_device", lambda idx: calls.append(("set_device", idx)))
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "init_process_group" for c in calls))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init_process_group", backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 13)


def _torchrun_env(monkeypatch, *, world, rank, local_rank, local_world):
    """What torchrun sets for a worker (distributed.launch_env refuses a partial set in one line)."""
    for name, value in {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize(("local_rank", "devices", "index"), [(5, 8, 5), (5, 4, 1), (3, 1, 0)])
def test_setup_binds_the_gpu_before_the_process_group(monkeypatch, local_rank, devices, index):
    """local_rank % device_count: one GPU visible per process (Slurm --gpus-per-task) is index 0."""
    from ndtrain.train import distributed

    calls: list = []
    _patched_cuda(monkeypatch, calls, devices)
    _torchrun_env(monkeypatch, world=16, rank=13, local_rank=local_rank, local_world=8)
    rt = distributed.setup(SimpleNamespace(device="auto", backend="auto", timeout_s=42.0))
    gpu = torch.device("cuda", index)
    assert [c[0] for c in calls] == ["set_device", "init_process_group"], calls
    assert calls[0] == ("set_device", index)
    backend, kw = calls[1][1], calls[1][2]
    assert backend == "nccl" and kw["device_id"] == gpu and kw["timeout"].total_seconds() == 42.0
    assert (rt.rank, rt.world_size, rt.local_rank, rt.device, rt.backend) == (13, 16, local_rank, gpu, "nccl")


def test_setup_on_cpu_binds_no_device(monkeypatch):
    import torch.distributed as dist

    from ndtrain.train import distributed

    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda idx: calls.append(("set_device", idx)))
    monkeypatch.setattr(dist, "is_initialized", lambda: any(c[0] == "init_process_group" for c in calls))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init_process_group", backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    _torchrun_env(monkeypatch, world=2, rank=1, local_rank=1, local_world=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rt = distributed.setup(SimpleNamespace(device="cpu", backend="auto", timeout_s=30.0))
    assert [c[0] for c in calls] == ["init_process_group"] and calls[0][1] == "gloo", calls
    assert "device_id" not in calls[0][2] and rt.device == torch.device("cpu")


# ---- fp8 needs a GPU that has float8 matmuls -----------------------------------------------------
@pytest.mark.parametrize(("capability", "refused"), [((7, 0), True), ((8, 0), True), ((8, 6), True),
                                                     ((8, 9), False), ((9, 0), False), ((10, 0), False)])
def test_fp8_is_refused_below_compute_capability_8_9(monkeypatch, capability, refused):
    from ndtrain.errors import NdtrainError
    from ndtrain.parallel import float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Some GPU")
    if not refused:
        float8.check_device(torch.device("cuda", 0))
        return
    with pytest.raises(NdtrainError) as exc:
        float8.check_device(torch.device("cuda", 0))
    text = str(exc.value)
    assert "parallel.mixed_precision" in text and "8.9" in text and "\n" not in text
    assert f"{capability[0]}.{capability[1]}" in text


def test_fp8_on_cpu_is_not_refused(monkeypatch):
    from ndtrain.parallel import float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    float8.check_device(torch.device("cpu"))


def test_fp8_conversion_refuses_an_old_gpu_before_touching_the_model(monkeypatch):
    """The check sits on the path every fp8 model takes (the composer's first transform)."""
    from torch import nn

    from ndtrain.errors import NdtrainError
    from ndtrain.parallel import float8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(NdtrainError, match="parallel.mixed_precision"):
        float8.apply_float8(model, SimpleNamespace(tp=1, fp8_recipe="tensorwise", shard_degree=1))
    assert type(model[0]) is nn.Linear


# ---- the Python the code needs -----------------------------------------------------------------
def test_requires_python_covers_the_standard_library_the_code_imports():
    """tomllib (3.11) is imported by the config loader; a 3.10 install would fail at import."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    low = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert low, f"requires-python {spec!r}: expected a plain lower bound"
    needs = {"tomllib": 11}
    for name, minor in needs.items():
        used = [p for p in (REPO / "src").rglob("*.py") if re.search(rf"^\s*import {name}\b", p.read_text(), re.M)]
        if used:
            assert int(low.group(1)) >= minor, f"{used[0]} imports {name} (3.{minor}), requires-python is {spec}"
