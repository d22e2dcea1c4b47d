"""What a run may touch in a checkpoints directory (issue 33, classes 2, 3, 4 and 10): a
checkpoint.dir is locked like the run directory; clean-up removes only ndtrain's own leftovers;
retention keeps a checkpoint that was read back intact while none of the kept ones was; a
resume that finds checkpoints but none usable stops and moves nothing; and a resume refuses a
model change that alters what the weights compute, unless the key is listed as a fine-tune."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ckpt_helpers import cfg_of, job, tree

from ndtrain.config import load_config
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.model.config import ModelConfig
from ndtrain.train.checkpoint import MARKER, list_checkpoints, model_mismatch, retention, step_name
from ndtrain.train.checkpoint.resume import choose_checkpoint, finish_abandoning
from ndtrain.train.rundir import claim
from ndtrain.train.run_files import LOCK_NAME


def _fake(root: Path, step: int) -> Path:
    """A directory retention and resume take for a published checkpoint (marker only)."""
    ckpt = root / step_name(step)
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text(ckpt.name + "\n")
    return ckpt


def _put(root: Path, rel: str, text: str = "x") -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)


# ---- class 3: only ndtrain's own names and contents ---------------------------------------------
def test_clean_up_removes_only_ndtrains_own_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for rel in (".step_00000003.partial/__0_0.distcp", ".step_00000003.partial/.metadata",
                ".step_00000002.deleting/train_state.json", ".step_00000002.deleting/COMPLETE"):
        _put(root, rel)
    (root / ".step_00000005.partial").mkdir()  # a save killed before it wrote anything
    users = {"photos.partial/cat.jpg", "old.deleting/a.txt", ".step_00000009.partial/notes.txt",
             ".step_00000008.partial/sub/__0_0.distcp", ".step_1.partial/__0_0.distcp"}
    for rel in users:
        _put(root, rel, "the user's own bytes")
    kept = tree(root)
    kept = {k: v for k, v in kept.items() if k in users}
    said: list[str] = []
    removed = retention.clear_leftovers(root, said.append)
    assert sorted(p.name for p in removed) == [".step_00000002.deleting", ".step_00000003.partial",
                                               ".step_00000005.partial"]
    assert tree(root) == kept
    assert len(said) == 2 and all("left" in m and "alone" in m for m in said), said


def test_a_foreign_journal_name_is_no_timeline_switch(tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 4)
    _put(root, ".abandoning-from-mine/notes.txt")
    before = tree(root)
    finish_abandoning(root, print)  # used to parse 'mine' as a step: ValueError
    assert tree(root) == before


def test_a_foreign_directory_in_a_saves_way_is_moved_aside_not_deleted(tmp_path):
    root = tmp_path / "checkpoints"
    _put(root, ".step_00000004.partial/notes.txt", "mine")
    said: list[str] = []
    retention.clear_partial(root / ".step_00000004.partial", root, said.append)
    assert not (root / ".step_00000004.partial").exists()
    [aside] = (root / "corrupt").iterdir()
    assert (aside / "notes.txt").read_text() == "mine" and "nothing deleted" in said[0]


# ---- class 4: never only unverified checkpoints; nothing usable stops ---------------------------
def test_retention_keeps_the_newest_read_back_checkpoint_while_no_kept_one_was(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake(root, step)
    read_back = {step_name(2)}  # 4 and 6 were only hashed as they were written

    def retain():
        retention.retain(root, 1, 0, lambda c: None, print, lambda c: c.name in read_back)
        return [c.name for c in list_checkpoints(root)]

    assert retain() == [step_name(2), step_name(6)]
    _fake(root, 8)
    read_back.add(step_name(6))  # read back before step 8 was saved: step 2 may go now
    assert retain() == [step_name(6), step_name(8)]
    # What is written is read back before the next save (and only then counts as verified).
    verdicts = {str(c): None for c in list_checkpoints(root)}
    assert retention.unverified(root, 1, verdicts, {str(root / step_name(8))}) == [root / step_name(8)]
    assert retention.unverified(root, 1, verdicts) == []


def test_resume_auto_that_finds_only_damaged_checkpoints_stops_and_moves_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    _fake(root, 4)  # no manifest: fails verification
    before = tree(root)
    said: list[str] = []
    path, error = choose_checkpoint("auto", root, 1, True, {}, said.append)
    assert path is None and "no usable checkpoint under" in error and "--train.overwrite=true" in error
    assert "\n" not in error and tree(root) == before
    # What an earlier ndtrain set aside as damaged counts as a checkpoint that existed.
    (root / "corrupt").mkdir()
    shutil.move(str(root / step_name(4)), str(root / "corrupt" / f"{step_name(4)}-20261201-000000"))
    _, error = choose_checkpoint("auto", root, 1, True, {}, said.append)
    assert "no usable checkpoint under" in error
    assert choose_checkpoint("auto", tmp_path / "fresh", 1, True, {}, said.append) == (None, None)  # none ever: fresh start


def test_keep_last_1_survives_its_newest_checkpoint_corrupted(parity_base, tmp_path):
    from ndtrain.train.trainer import Trainer, train

    run = tmp_path / "run"
    train(cfg_of(job(parity_base, run, train={"steps": 4}, checkpoint={"interval_steps": 2, "keep_last": 1})))
    root = run / "checkpoints"
    assert [c.name for c in list_checkpoints(root)] == [step_name(2), step_name(4)]

    def resumer():
        cfg = cfg_of(job(parity_base, run, train={"steps": 4}, checkpoint={"keep_last": 1}))
        trainer = Trainer(cfg, run_dir=None, log=False)
        ck = trainer.checkpointer(run, cfg)
        ck._info = lambda text: None
        return trainer, ck

    def flip(ckpt: Path):
        shard = ckpt / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    flip(root / step_name(4))
    trainer, ck = resumer()
    assert ck.resume("auto").name == step_name(2) and trainer.step == 2
    flip(root / step_name(2))
    before = tree(run)
    trainer, ck = resumer()
    with pytest.raises(NdtrainError, match=r"no usable checkpoint under .*step_00000002: file __0_0\.distcp fails"):
        ck.resume("auto")
    assert trainer.step == 0 and tree(run) == before


# ---- class 10: what the weights compute -----------------------------------------------------------
def test_resume_refuses_every_change_to_what_the_weights_compute():
    here = ModelConfig()
    saved = {"config": {"model": {**vars(ModelConfig()), "rope_theta": 500000.0, "norm_eps": 1e-6}}}
    problem = model_mismatch(here, saved)
    assert "model.rope_theta=500000.0 but this run has 10000.0" in problem and "model.norm_eps=1e-06" in problem
    assert "allow_model_change" in problem and "\n" not in problem
    assert model_mismatch(here, saved, ("rope_theta", "norm_eps")) is None  # an explicit fine-tune
    assert model_mismatch(here, saved, ("rope_theta",)) is not None
    for key, value in (("router", "sigmoid"), ("load_balance", "none"), ("n_active_experts", 2),
                       ("capacity_factor", 1.25)):
        assert f"model.{key}" in model_mismatch(here, {"config": {"model": {key: value}}}), key
    assert "different model shape" in model_mismatch(here, {"config": {"model": {"tie_embeddings": True}}})
    # Keys that leave the function alone (initialisation, the RoPE table's length, a name) may change.
    for key, value in (("init_std", 0.05), ("max_seq_len", 4096), ("preset", "tiny"), ("aux_loss_coef", 0.1)):
        assert model_mismatch(here, {"config": {"model": {key: value}}}) is None, key


def test_only_keys_that_keep_the_tensors_may_be_allowed_to_change():
    assert load_config(None, {"checkpoint": {"allow_model_change": ["rope_theta"]}}).checkpoint.allow_model_change \
        == ["rope_theta"]
    with pytest.raises(ConfigError, match=r"checkpoint\.allow_model_change.*may list only"):
        load_config(None, {"checkpoint": {"allow_model_change": ["dim"]}})


# ---- class 2: one live run per checkpoints directory ----------------------------------------------
def _claim(tmp_path: Path, out: str, ckpt_dir: str = ""):
    cfg = load_config(None, {"train": {"output_dir": str(tmp_path / out)},
                             "checkpoint": {"dir": str(tmp_path / ckpt_dir) if ckpt_dir else ""}})
    return claim(cfg, tmp_path / out, log=lambda text: None)


def test_a_checkpoint_dir_is_locked_with_its_run(tmp_path):
    a = _claim(tmp_path, "a", "shared")
    try:
        assert (tmp_path / "shared" / LOCK_NAME).is_file()
        with pytest.raises(NdtrainError, match=r"shared is in use by a live run .*checkpoint\.dir"):
            _claim(tmp_path, "b", "shared")
        assert not (tmp_path / "b" / LOCK_NAME).exists()  # b let go of its own directory's lock
        # A run's default checkpoints directory is locked too: another run cannot name it.
        c = _claim(tmp_path, "c")
        try:
            with pytest.raises(NdtrainError, match=r"in use by a live run"):
                _claim(tmp_path, "d", "c/checkpoints")
        finally:
            c.release()
    finally:
        a.release()
    assert not (tmp_path / "shared" / LOCK_NAME).exists() and not (tmp_path / "a" / LOCK_NAME).exists()
    _claim(tmp_path, "b", "shared").release()  # free again once its run has ended
