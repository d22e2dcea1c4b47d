"""A run directory belongs to one run (refusal, overwrite moves aside, stale locks), retention
counts only checkpoints that verify, resuming an older checkpoint starts a new timeline that
resume=auto follows, and a full disk costs nothing but the checkpoint being written."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from ckpt_helpers import cfg_of, job, tree

from ndtrain.errors import NdtrainError, RunError
from ndtrain.train.checkpoint import list_checkpoints, read_train_state, step_name, verify_checkpoint
from ndtrain.train.checkpoint import manager as checkpoint_mod
from ndtrain.train.run_files import LOCK_NAME
from ndtrain.train.trainer import train


def _run(parity_base, out: Path, steps: int, **ckpt):
    return train(cfg_of(job(parity_base, out, train={"steps": steps},
                            checkpoint={"interval_steps": 1, "keep_last": 3, **ckpt})))


def _bitflip(ckpt: Path) -> None:
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def base_run(parity_base, tmp_path_factory):
    """Checkpoints at steps 2, 3 and 4 (keep_last 3)."""
    out = tmp_path_factory.mktemp("base") / "run"
    _run(parity_base, out, 4)
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == [step_name(s) for s in (2, 3, 4)]
    return out


def test_a_run_writes_only_the_entries_it_lists(base_run):
    """What run_files.RUN_ENTRIES names is what the ownership and link checks guard: a run
    that wrote anything else in its directory would write it unguarded."""
    from ndtrain.train.run_files import RUN_ENTRIES, RUN_MARKER

    assert (base_run / RUN_MARKER).is_file()
    assert {p.name for p in base_run.iterdir()} <= {RUN_MARKER, *RUN_ENTRIES}


def _copy(base_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def test_fresh_run_refused_then_overwrite_moves_the_old_run_aside(base_run, parity_base, tmp_path, capsys):
    out = _copy(base_run, tmp_path)
    before = tree(out)
    with pytest.raises(NdtrainError, match=r"holds an earlier run .*--checkpoint\.resume=auto.*--train\.overwrite"):
        _run(parity_base, out, 2)
    assert tree(out) == before  # refused before anything was created, the lock file included
    # Resuming from a checkpoint elsewhere would also start a second run here: refused too.
    with pytest.raises(NdtrainError, match="holds an earlier run"):
        train(cfg_of(job(parity_base, out, train={"steps": 5},
                         checkpoint={"resume": str(base_run / "checkpoints" / step_name(2))})))
    assert tree(out) == before

    summary = train(cfg_of(job(parity_base, out, train={"steps": 2, "overwrite": True})))
    assert summary["steps"] == 2
    [aside] = tmp_path.glob("run.replaced-*")
    assert tree(aside) == before  # the whole old run, byte for byte (sizes; contents below)
    for rel in before:
        assert (aside / rel).read_bytes() == (base_run / rel).read_bytes()
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == [step_name(2)]
    assert "moved the earlier run's files to" in capsys.readouterr().out
    assert not (out / LOCK_NAME).exists()


def test_resume_auto_needs_an_existing_run_directory(parity_base, tmp_path):
    with pytest.raises(NdtrainError, match=r"checkpoint\.resume.*does not exist"):
        train(cfg_of(job(parity_base, tmp_path / "typo", checkpoint={"resume": "auto"})))
    assert not (tmp_path / "typo").exists()
    (tmp_path / "new").mkdir()  # an existing, empty directory: a first attempt that later ones continue
    summary = train(cfg_of(job(parity_base, tmp_path / "new", train={"steps": 1}, checkpoint={"resume": "auto"})))
    assert summary["steps"] == 1


def test_a_stale_lock_is_taken_over_with_a_message_and_a_live_one_refuses(base_run, parity_base, tmp_path, capsys):
    out = _copy(base_run, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": "gone-host", "started": 1.0}))
    summary = _run(parity_base, out, 5, resume="auto")
    assert summary["steps"] == 5
    assert f"took over the lock of a run that is gone (pid {int(dead.stdout)} on host gone-host" in capsys.readouterr().out

    # A live holder (another process) keeps everyone else out.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from ndtrain.train.rundir import RunLock; "
                               f"RunLock.acquire(sys.argv[1]); print('locked', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree(out)
        with pytest.raises(NdtrainError, match=rf"in use by a live run \(pid {holder.pid} on host"):
            _run(parity_base, out, 6, resume="auto")
        assert tree(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_retention_counts_only_checkpoints_that_verify(base_run, parity_base, tmp_path):
    """Step 3 (of 2, 3, 4) is corrupted. The continued run keeps three *intact* checkpoints:
    today's rule (the newest three by name) would have kept the bad 3 and deleted the good 2."""
    out = _copy(base_run, tmp_path)
    bad = out / "checkpoints" / step_name(3)
    _bitflip(bad)
    bad_files = {p.name: p.read_bytes() for p in bad.iterdir()}
    _run(parity_base, out, 5, resume="auto")
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == [step_name(s) for s in (2, 4, 5)]
    assert all(verify_checkpoint(c) is None for c in list_checkpoints(out / "checkpoints"))
    [aside] = (out / "checkpoints" / "corrupt").iterdir()  # moved aside, never counted, never deleted
    assert aside.name.startswith(step_name(3)) and {p.name: p.read_bytes() for p in aside.iterdir()} == bad_files


def test_corrupt_newest_checkpoint_good_ones_survive(base_run, parity_base, tmp_path):
    out = _copy(base_run, tmp_path)
    _bitflip(out / "checkpoints" / step_name(4))
    summary = _run(parity_base, out, 5, resume="auto")
    assert summary["steps"] == 5
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-2:] == [4, 5]  # steps 4 and 5 trained again from 3
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == [step_name(s) for s in (3, 4, 5)]
    assert all(verify_checkpoint(c) is None for c in list_checkpoints(out / "checkpoints"))
    assert [p.name.split("-")[0] for p in (out / "checkpoints" / "corrupt").iterdir()] == [step_name(4)]


def test_resuming_an_older_checkpoint_starts_a_timeline_that_auto_follows(base_run, parity_base, tmp_path):
    out = _copy(base_run, tmp_path)
    old4 = (out / "checkpoints" / step_name(4) / "__0_0.distcp").read_bytes()
    # Branch from step 2, train to 3 ("a later crash" follows).
    _run(parity_base, out, 3, resume=str(out / "checkpoints" / step_name(2)))
    [abandoned] = (out / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in abandoned.iterdir()) == [step_name(3), step_name(4)]
    assert (abandoned / step_name(4) / "__0_0.distcp").read_bytes() == old4
    new3 = read_train_state(out / "checkpoints" / step_name(3))
    assert new3["timeline"]["parent"].startswith(step_name(2))
    # resume=auto continues the new timeline (its step 3), not the abandoned step 4.
    summary = _run(parity_base, out, 4, resume="auto")
    assert summary["steps"] == 4
    state4 = read_train_state(out / "checkpoints" / step_name(4))
    assert state4["timeline"]["id"] == new3["timeline"]["id"]


def test_an_interrupted_timeline_switch_is_finished_at_the_next_start(base_run, parity_base, tmp_path):
    """A crash between the journal and the moves must not leave the old timeline resumable."""
    out = _copy(base_run, tmp_path)
    (out / "checkpoints" / ".abandoning-from-00000002-20260101-000000").mkdir()
    summary = _run(parity_base, out, 3, resume="auto")
    assert summary["steps"] == 3
    abandoned = out / "checkpoints" / "abandoned-20260101-000000"
    assert sorted(p.name for p in abandoned.iterdir()) == [step_name(3), step_name(4)]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert rows[-1]["step"] == 3  # resumed from 2, trained step 3 again


def test_disk_full_one_line_partial_removed_previous_stays(parity_base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    calls = {"n": 0}
    original = checkpoint_mod.dcp.save

    def save(state, checkpoint_id, **kw):
        calls["n"] += 1
        original(state, checkpoint_id=checkpoint_id, **kw)
        if calls["n"] >= 2:  # the second checkpoint finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(checkpoint_id) / "__0_0.distcp"))

    monkeypatch.setattr(checkpoint_mod.dcp, "save", save)
    with pytest.raises(RunError) as err:
        train(cfg_of(job(parity_base, out, train={"steps": 4}, checkpoint={"interval_steps": 2})))
    msg = str(err.value)
    assert "\n" not in msg and err.value.exit_code == 1
    assert "no space left" in msg and str(out / "checkpoints") in msg and "bytes" in msg
    assert f"{out / 'checkpoints' / step_name(2)} is still the newest published checkpoint" in msg
    assert [p.name for p in (out / "checkpoints").iterdir()] == [step_name(2)]  # the partial is gone
    assert verify_checkpoint(out / "checkpoints" / step_name(2)) is None


def _can_mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(path)], check=True)
    return ok


@pytest.mark.timeout(300)
def test_disk_full_on_a_real_small_file_system(corpus_dir, tmp_path, hang_deadline):
    """A 5 MB tmpfs holds one debug checkpoint (3.7 MB), not two: the second save fails."""
    small = tmp_path / "small"
    if os.geteuid() != 0 or not shutil.which("mount") or not _can_mount_tmpfs(small):
        pytest.skip("needs permission to mount a tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(small)], check=True)
    try:
        out = tmp_path / "run"
        ckpts = small / "ckpts"
        proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", f"--data.path={corpus_dir}",
                               "--data.seq_len=64", "--train.global_batch=8", "--train.micro_batch=8",
                               "--train.steps=4", "--train.val_interval=0", "--train.sample_tokens=0",
                               "--checkpoint.interval_steps=2", "--logging.tensorboard=false",
                               f"--train.output_dir={out}", f"--checkpoint.dir={ckpts}"],
                              capture_output=True, text=True, timeout=hang_deadline(240), env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "no space left" in lines[0] and str(ckpts) in lines[0] and "bytes" in lines[0], lines
        assert sorted(p.name for p in ckpts.iterdir()) == [step_name(2)]
        assert verify_checkpoint(ckpts / step_name(2)) is None
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_async_save_failure_is_reported_and_cleaned(parity_base, tmp_path, monkeypatch):
    from concurrent.futures import Future

    out = tmp_path / "run"
    original = checkpoint_mod.dcp.async_save

    def async_save(state, checkpoint_id, **kw):
        if Path(checkpoint_id).name == f".{step_name(4)}.partial":
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
            failed = Future()
            failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
            return failed
        return original(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(checkpoint_mod.dcp, "async_save", async_save)
    with pytest.raises(RunError, match=r"no space left.*step_00000002 is still the newest"):
        train(cfg_of(job(parity_base, out, train={"steps": 6}, checkpoint={"interval_steps": 2, "async": True})))
    assert [p.name for p in (out / "checkpoints").iterdir()] == [step_name(2)]


def test_verification_is_shared_over_ranks(parity_base, tmp_path, hang_deadline):
    """World 2: each rank hashes about half the bytes; both reach the same verdicts, including
    for a corrupt checkpoint whose bad file only one of them hashed."""
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.train.checkpoint.digest import shares

    out = tmp_path / "run"
    _run(parity_base, out, 3)
    _bitflip(out / "checkpoints" / step_name(3))
    verdicts = run_ranks(2, _verify_both, [str(c) for c in list_checkpoints(out / "checkpoints")], timeout_s=hang_deadline(120))
    assert verdicts[0] == verdicts[1]
    assert verdicts[0][str(out / "checkpoints" / step_name(3))].endswith("fails its SHA-256 checksum (corrupted)")
    assert verdicts[0][str(out / "checkpoints" / step_name(2))] is None
    split = shares([(f"f{i}", size) for i, size in enumerate([100, 90, 50, 40, 30, 5])], 2)
    assert [sum(s for _, s in part) for part in split] == [170, 145]  # largest first, to the lighter


def _verify_both(paths: list[str]) -> dict:
    from ndtrain.train.checkpoint.digest import verify_shared

    return verify_shared([Path(p) for p in paths])


def test_each_rank_hashes_what_it_wrote(parity_base, tmp_path, hang_deadline):
    """World 2, FSDP: the manifest combines both ranks' digests and the checkpoint verifies."""
    from ndtrain.parallel.launch import run_ranks

    root = tmp_path / "ckpts"
    run_ranks(2, _save_fsdp, job(parity_base, train={"steps": 2}), str(root), uuid.uuid4().hex, timeout_s=hang_deadline(120))
    ckpt = root / "checkpoints" / step_name(1)
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "train_state.json"} <= set(manifest)
    assert not list(ckpt.glob(".digests-*")) and verify_checkpoint(ckpt) is None


def _save_fsdp(base: dict, root: str, _tag: str) -> None:
    from ndtrain.train.trainer import Trainer

    cfg = cfg_of({**base, "parallel": {"dp_shard": 2}})
    trainer = Trainer(cfg, run_dir=None, log=False)
    trainer.train_step()
    ck = trainer.checkpointer(Path(root), cfg)
    ck.save()
    ck.finish()


def test_a_rank_that_died_after_writing_is_hashed_by_rank_0(tmp_path):
    """Its digests never come; its shard is complete, so rank 0 hashes it after the grace period
    and the checkpoint is published all the same (and verifies)."""
    import hashlib

    from ndtrain.train.checkpoint.digest import collect_digests, write_own_digests

    tmp = tmp_path / ".step_00000001.partial"
    tmp.mkdir()
    for rank in (0, 1):
        (tmp / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
    (tmp / ".metadata").write_bytes(b"meta")
    write_own_digests(tmp, 0)  # rank 1 died before writing its digests
    entries = collect_digests(tmp, world=2, grace_s=0.2)
    assert set(entries) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert entries["__1_0.distcp"]["sha256"] == hashlib.sha256(bytes([1]) * 1000).hexdigest()
    assert not list(tmp.glob(".digests-*"))
