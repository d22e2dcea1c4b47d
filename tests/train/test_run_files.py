"""A run writes only its own files in its run directory, never through a link (train/run_files.py),
and a run directory ndtrain derives stays inside runs/. In-process and without training: the
command-line cases (one line, nothing lost) are in tests/cli/test_bad_input.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.train import run_files
from ndtrain.train.run_files import (LOCK_NAME, RUN_ENTRIES, RUN_MARKER, check_entries, open_run_log,
                                     write_run_file)
from ndtrain.train.rundir import RunLock, check_derived, claim, written_entries


def _cfg(out: Path | None = None, **train):
    return load_config(None, {"train": {"output_dir": str(out) if out else "", **train},
                              "logging": {"tensorboard": False}})


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own bytes\n")
    return victim


def test_write_run_file_replaces_links_and_follows_the_umask(tmp_path):
    victim = _victim(tmp_path)
    soft, hard = tmp_path / "a.toml", tmp_path / "b.toml"
    soft.symlink_to(victim)
    os.link(victim, hard)
    old = os.umask(0o022)
    try:
        write_run_file(soft, "x = 1\n")
        write_run_file(hard, b"y = 2\n")
    finally:
        os.umask(old)
    assert victim.read_text() == "the user's own bytes\n"
    assert not soft.is_symlink() and soft.read_text() == "x = 1\n" and hard.read_text() == "y = 2\n"
    assert stat.S_IMODE(soft.stat().st_mode) == 0o644  # 0o666 less the umask, not mkstemp's 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toml", "b.toml", "victim.txt"]  # no temporaries left


def test_open_run_log_never_writes_through_a_link(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(victim)
    with pytest.raises(NdtrainError, match="link.jsonl is a symbolic link"):
        open_run_log(tmp_path / "link.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")  # no reader: a blocking open would hang here
    with pytest.raises(NdtrainError, match="fifo.jsonl"):
        open_run_log(tmp_path / "fifo.jsonl")
    # A hard-linked snapshot of the run keeps its bytes; the run's own copy goes on.
    log = tmp_path / "metrics.jsonl"
    os.link(victim, log)
    with open_run_log(log) as f:
        f.write("row\n")
    assert victim.read_text() == "the user's own bytes\n"
    assert log.read_text() == "the user's own bytes\nrow\n" and log.stat().st_nlink == 1


def test_the_lock_is_never_a_link(tmp_path):
    victim = _victim(tmp_path)
    for kind, run in (("symbolic", tmp_path / "s"), ("hard", tmp_path / "h")):
        run.mkdir()
        (run / LOCK_NAME).symlink_to(victim) if kind == "symbolic" else os.link(victim, run / LOCK_NAME)
        with pytest.raises(NdtrainError, match=r"\.ndtrain\.lock is (a symbolic link|not a regular file of its own)"):
            RunLock.acquire(run)
    assert victim.read_text() == "the user's own bytes\n"


def test_a_users_file_of_a_run_files_name_is_refused_until_a_run_marks_the_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.toml").write_text("[train]\n")
    with pytest.raises(ConfigError, match=r"config\.toml exists and no ndtrain run made it"):
        check_entries(out)
    (out / RUN_MARKER).write_text("{}")
    assert check_entries(out) is True  # a run's own directory: it rewrites its own files
    # A directory an ndtrain from before the marker made: it holds a published checkpoint.
    old = tmp_path / "old"
    (old / "checkpoints" / "step_00000002").mkdir(parents=True)
    (old / "checkpoints" / "step_00000002" / "COMPLETE").write_text("")
    (old / "metrics.jsonl").write_text("{}\n")
    assert check_entries(old) is False


def test_only_what_this_run_writes_is_checked(tmp_path):
    out = tmp_path / "out"
    (out / "wandb").mkdir(parents=True)  # the user's own W&B directory: this run logs to TensorBoard
    (out / "notes.txt").write_text("mine")
    cfg = _cfg(out)
    assert "wandb" not in written_entries(cfg) and "checkpoints" in written_entries(cfg)
    elsewhere = load_config(None, {"train": {"output_dir": str(out)}, "checkpoint": {"dir": str(tmp_path / "c")}})
    assert "checkpoints" not in written_entries(elsewhere) and "tensorboard" in written_entries(elsewhere)
    lock = claim(cfg, out)
    try:
        assert json.loads((out / RUN_MARKER).read_text())["version"] == 1
    finally:
        lock.release()
    # (the checkpoint directory's own lock may have made an empty checkpoints/: the run's)
    assert {p.name for p in out.iterdir()} - {"checkpoints"} == {RUN_MARKER, "notes.txt", "wandb"}
    assert (out / "notes.txt").read_text() == "mine" and not any((out / "wandb").iterdir())


def test_overwrite_moves_only_the_runs_own_entries(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / RUN_MARKER).write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    with pytest.raises(NdtrainError, match="holds an earlier run"):
        claim(_cfg(out), out)
    lock = claim(_cfg(out, overwrite=True), out, log=lambda text: None)
    lock.release()
    [aside] = tmp_path.glob("out.replaced-*")
    assert sorted(p.name for p in aside.iterdir()) == [RUN_MARKER, "metrics.jsonl"]
    assert {p.name for p in out.iterdir()} - {"checkpoints"} == {RUN_MARKER, "notes.txt"}  # a new marker; the notes stay


def test_a_derived_run_directory_stays_inside_runs(monkeypatch):
    cfg = _cfg()
    check_derived(cfg, Path("runs") / "debug-20260101-000000")
    cfg.name = "../../x"  # load_config refuses it (tests/cli); a config built otherwise is caught here
    with pytest.raises(ConfigError, match="'name'"):
        check_derived(cfg, Path("runs") / f"{cfg.name}-20260101-000000")
    cfg.name = "debug"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "../../elsewhere")
    with pytest.raises(NdtrainError, match="TORCHELASTIC_RUN_ID='../../elsewhere'"):
        check_derived(cfg, Path("runs") / "debug-../../elsewhere")
    check_derived(_cfg(Path("/anywhere")), Path("/anywhere"))  # a directory the user gives is theirs


def test_the_list_of_run_entries_names_what_the_writers_write():
    """A trained run's own entries are checked in tests/train/test_run_dir.py; the trackers'
    state file is named in trackers.py."""
    from ndtrain.train.trackers import STATE_FILE

    assert STATE_FILE in run_files.RUN_FILES and set(run_files.RUN_FILES) <= set(RUN_ENTRIES)
