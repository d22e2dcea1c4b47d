"""First contact with a GPU host, on CPU: `train.device = "auto"` refuses (one line naming the
cause) where a GPU is visible but torch cannot use it, rather than training on the CPU; the CUDA
allocator gets expandable segments unless the user configured it; the run lock works on a file
system without flock."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.train import distributed, run_lock
from ndtrain.train.run_files import LOCK_NAME
from ndtrain.train.run_lock import RunLock


# ---- device = "auto" ------------------------------------------------------------------------------
@pytest.fixture
def no_gpu_probes(monkeypatch):
    """A host where nothing says there is a GPU, whatever this one has."""
    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(distributed.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("probe", ["node", "smi", "env"])
def test_auto_refuses_a_visible_gpu_torch_cannot_use(no_gpu_probes, monkeypatch, probe):
    if probe == "node":
        monkeypatch.setattr(distributed.glob, "glob", lambda pattern: ["/dev/nvidia0"])
        seen = "/dev/nvidia0"
    elif probe == "smi":
        monkeypatch.setattr(distributed.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
        seen = "nvidia-smi"
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        seen = "CUDA_VISIBLE_DEVICES=0,1"
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError) as err:
        distributed.choose_device("auto", "auto")
    text = str(err.value)
    assert "\n" not in text and err.value.exit_code == 2
    assert "train.device" in text and seen in text and "built without CUDA" in text and "device='cpu'" in text


def test_the_refusal_quotes_the_driver_when_torch_has_cuda(no_gpu_probes, monkeypatch):
    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def init():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12020).\nmore detail")

    monkeypatch.setattr(torch.cuda, "init", init)
    with pytest.raises(ConfigError, match=r"CUDA 13\.0 runtime: The NVIDIA driver on your system is too old "
                                          r"\(found version 12020\)\.\)") as err:
        distributed.choose_device("auto", "auto")
    assert "more detail" not in str(err.value)


def test_cpu_is_chosen_when_asked_or_when_no_gpu_is_visible(no_gpu_probes, monkeypatch):
    assert distributed.choose_device("auto", "auto") == ("cpu", "gloo")
    for hidden in ("", "-1"):  # a scheduler hiding every GPU
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert distributed.choose_device("auto", "auto") == ("cpu", "gloo")
    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert distributed.choose_device("cpu", "auto") == ("cpu", "gloo")  # the user's choice stands


# ---- the CUDA allocator ---------------------------------------------------------------------------
def test_expandable_segments_by_default_and_a_users_setting_wins():
    env = {}
    assert distributed.default_allocator(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in distributed.ALLOC_CONF_ENV:
        env = {name: "max_split_size_mb:128"}
        assert not distributed.default_allocator(env) and env == {name: "max_split_size_mb:128"}


def test_setup_sets_the_allocator_before_cuda_starts_and_only_for_cuda(monkeypatch):
    order = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(distributed, "choose_device", lambda device, backend: (device, "gloo"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "bind_device", lambda kind, rank: order.append(
        os.environ.get("PYTORCH_CUDA_ALLOC_CONF")) or torch.device("cpu"))
    monkeypatch.setattr(distributed, "keep_freed_memory", lambda: False)
    cfg = type("T", (), {"device": "cpu", "backend": "auto", "timeout_s": 60})()
    distributed.setup(cfg)
    cfg.device = "cuda"
    distributed.setup(cfg)
    assert order == [None, "expandable_segments:True"]


# ---- the run lock without flock ---------------------------------------------------------------------
@pytest.fixture
def no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", flock)


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_without_flock_the_lock_is_a_file_that_excludes_and_is_released(no_flock, tmp_path):
    lock = RunLock.acquire(tmp_path)
    assert "without flock (ENOSYS)" in lock.note and "\n" not in lock.note
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # the private name is gone
    probe = ("import sys; from ndtrain.train.rundir import RunLock\n"
             "try:\n    RunLock.acquire(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    # Another process finds it held: the lock file alone excludes it (its fcntl is the real one,
    # which on this file system works, so the child is told to use the file way too).
    child = subprocess.run([sys.executable, "-c", "import fcntl, errno\n"
                            "def f(fd, op): raise OSError(errno.ENOSYS, 'no')\nfcntl.flock = f\n" + probe,
                            str(tmp_path)], capture_output=True, text=True, check=True)
    assert child.stdout.startswith("NdtrainError") and f"pid {os.getpid()} on host" in child.stdout
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_without_flock_a_dead_runs_lock_is_taken_over_and_another_hosts_refused(no_flock, tmp_path):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "run_id": ""}))
    lock = RunLock.acquire(tmp_path)
    assert lock.previous["pid"] == dead and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    other = {"pid": dead, "host": "another-host", "run_id": "job-7"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(NdtrainError, match=r"another-host.*no flock \(ENOSYS\).*remove .*\.ndtrain\.lock"):
        RunLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == other  # another host's lock is left as it was
    lock = RunLock.acquire(tmp_path, run_id="job-7")  # that run's own next attempt takes it over
    assert lock.previous == other
    lock.release()


def test_claim_says_so_in_one_line(no_flock, tmp_path):
    from ndtrain.config import load_config
    from ndtrain.train.rundir import claim

    lines = []
    out = tmp_path / "run"
    lock = claim(load_config(None, {"train": {"output_dir": str(out)}}), out, log=lines.append)
    lock.release()
    assert [line for line in lines if "flock" in line] == [lock.note] and "\n" not in lock.note


def test_flock_is_probed_not_assumed(tmp_path):
    assert run_lock._flock_missing(tmp_path) == ""  # this file system has flock
