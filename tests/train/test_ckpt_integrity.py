"""Corrupt or foreign inputs are rejected with one clear message, nothing is deleted, and
`resume=auto` falls back to the previous good checkpoint. Also retention and atomic publish."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cfg_of, job, tree

from ndtrain.errors import NdtrainError
from ndtrain.train.checkpoint import MANIFEST, MARKER, list_checkpoints, step_name, write_manifest
from ndtrain.train.trainer import Trainer, train


@pytest.fixture(scope="module")
def saved_run(parity_base, tmp_path_factory):
    """A run with published checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(cfg_of(job(parity_base, run, train={"steps": 4}, checkpoint={"interval_steps": 2, "keep_last": 3})))
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == [step_name(2), step_name(4)]
    return run


def _copy(saved_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run


def _resumer(parity_base, run: Path, **sections):
    cfg = cfg_of(job(parity_base, run, **sections))
    trainer = Trainer(cfg, run_dir=None, log=False)
    ck = trainer.checkpointer(run, cfg)
    messages: list[str] = []
    ck._info = messages.append
    return trainer, ck, messages


def _truncate(ck: Path):
    shard = ck / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _bitflip(ck: Path):
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _bad_manifest_checksum(ck: Path):
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"][".metadata"]["sha256"] = "0" * 64
    (ck / MANIFEST).write_text(json.dumps(manifest))


def _no_marker(ck: Path):
    (ck / MARKER).unlink()


CORRUPTIONS = {
    "truncated shard": (_truncate, "the manifest says"),
    "flipped byte": (_bitflip, "fails its SHA-256 checksum"),
    "bad manifest checksum": (_bad_manifest_checksum, "fails its SHA-256 checksum"),
    "missing marker": (_no_marker, "no COMPLETE marker"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_is_skipped_and_rejected_and_kept(kind, saved_run, parity_base, tmp_path):
    corrupt, reason = CORRUPTIONS[kind]
    run = _copy(saved_run, tmp_path)
    newest = run / "checkpoints" / step_name(4)
    corrupt(newest)
    before = tree(run / "checkpoints")

    trainer, ck, messages = _resumer(parity_base, run, train={"steps": 4})
    with pytest.raises(NdtrainError, match=reason) as err:
        ck.resume(str(newest))
    assert "\n" not in str(err.value) and str(newest) in str(err.value)
    assert trainer.step == 0

    loaded = ck.resume("auto")
    assert loaded.name == step_name(2) and trainer.step == 2
    after = tree(run / "checkpoints")
    if kind == "missing marker":  # an unmarked directory is not even a candidate: left alone
        assert after == before
        return
    assert any(reason in m and step_name(4) in m and "moved to" in m for m in messages), messages
    # Moved aside to corrupt/, byte for byte; nothing deleted or rewritten.
    [aside] = (run / "checkpoints" / "corrupt").iterdir()
    assert aside.name.startswith(step_name(4) + "-")
    moved = {k.replace(f"corrupt/{aside.name}/", f"{step_name(4)}/"): v for k, v in after.items()}
    assert moved == before


def test_other_model_shape_is_rejected(saved_run, parity_base, tmp_path):
    run = _copy(saved_run, tmp_path)
    before = tree(run)
    _, ck, _ = _resumer(parity_base, tmp_path / "other", model={"preset": "debug", "dim": 128})
    with pytest.raises(NdtrainError, match=r"model.dim=64 but this run has 128: it belongs to a different model"):
        ck.resume(str(run / "checkpoints"))
    assert tree(run) == before


def test_pickle_files_are_never_unpickled(saved_run, parity_base, tmp_path):
    run = _copy(saved_run, tmp_path)
    trainer, ck, _ = _resumer(parity_base, tmp_path / "other")
    # A torch.save/pickle file handed over as a checkpoint.
    pt = tmp_path / "model.pt"
    torch.save(trainer.state.model.state_dict(), pt)
    with pytest.raises(NdtrainError, match="looks like a pickle"):
        ck.resume(str(pt))

    # A directory that passes every integrity check but whose DCP metadata is a hostile pickle.
    evil = run / "checkpoints" / step_name(4)
    canary = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (canary,))

    (evil / ".metadata").write_bytes(pickle.dumps(Payload()))
    write_manifest(evil)
    before = tree(run)
    with pytest.raises(NdtrainError, match="refused to read checkpoint metadata"):
        ck.resume(str(evil))
    assert not canary.exists() and tree(run) == before


def test_other_data_is_rejected(saved_run, parity_base, tmp_path):
    from ndtrain.data.prepare import prepare

    other = tmp_path / "other-data"
    prepare(None, other, tokenizer="byte", val_fraction=0.05, max_bytes=150_000)
    run = _copy(saved_run, tmp_path)
    _, ck, _ = _resumer(parity_base, run, data={"path": str(other)})
    with pytest.raises(NdtrainError, match="trained on different data .*(source|stream)_sha256"):
        ck.resume("auto")


def test_retention_and_republish_keep_everything_they_must(parity_base, tmp_path):
    run = tmp_path / "run"
    train(cfg_of(job(parity_base, run, train={"steps": 7},
                     checkpoint={"interval_steps": 1, "keep_last": 2, "keep_every": 3})))
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == [step_name(s) for s in (3, 6, 7)]

    # A stale partial from a killed save is cleared; resuming from step 6 starts a new timeline:
    # the old step 7 moves to abandoned-<time>/ (nothing deleted) before the new one is written.
    (run / "checkpoints" / ".step_00000009.partial").mkdir()
    old7 = tree(run / "checkpoints" / step_name(7))
    trainer, ck, messages = _resumer(parity_base, run, train={"steps": 7})
    assert not (run / "checkpoints" / ".step_00000009.partial").exists()
    ck.resume(str(run / "checkpoints" / step_name(6)))
    [abandoned] = (run / "checkpoints").glob("abandoned-*")
    assert tree(abandoned / step_name(7)) == old7
    assert any("abandoned timeline" in m for m in messages), messages
    trainer.state.progress.step = 7
    ck.save()
    assert [c.name for c in list_checkpoints(run / "checkpoints")] == [step_name(6), step_name(7)]


def test_global_batch_must_divide_over_data_parallel_ranks(parity_base):
    """The batch rule (layout/rules.py), checked once, when the plan is resolved for a world: for
    every batch of the run, its ramp's stages included, naming the key that sets it."""
    from ndtrain.train.plan import as_written

    cfg = cfg_of(job(parity_base, train={"global_batch": 8, "micro_batch": 1, "batch_ramp": [[1000, 12]]}))
    assert as_written(cfg, 4).layout.dp == 4  # 8 and 12 both split over 4
    with pytest.raises(NdtrainError, match=r"global batch 8 \(train.global_batch\) cannot be split evenly over 3"):
        as_written(cfg, 3)
    with pytest.raises(NdtrainError, match=r"'train.batch_ramp'.*global batch 12 \(train.batch_ramp\).*over 8"):
        as_written(cfg, 8)


def test_cli_refuses_a_world_that_cannot_keep_the_global_batch(corpus_dir, tmp_path, hang_deadline):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ndtrain", "train", "--nproc", "3", "--train.global_batch=8",
                           f"--data.path={corpus_dir}", f"--train.output_dir={tmp_path / 'r'}"],
                          capture_output=True, text=True, timeout=hang_deadline(120))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "global batch 8 (train.global_batch) cannot be split evenly over 3 data-parallel ranks" in proc.stderr
    assert "[1, 2, 4, 8]" in proc.stderr and not (tmp_path / "r").exists()
