"""Everything about a run that can be known before its first step is checked before it: the
data (readable, its vocabulary within the model's, enough training samples, enough validation
samples for `val_batches` at this `seq_len`) and the checkpoint to resume (it exists, it is a
checkpoint, its model shape is this model's). Read-only: a refused run leaves no trace.

The `--nproc` launcher runs these before it starts any worker; a single process or rank 0 of a
torchrun group runs them before building the model. (Layout checks live with the layout.)
"""

from __future__ import annotations

from pathlib import Path

from ndtrain.errors import ConfigError, NdtrainError


def check_data(cfg) -> None:
    from ndtrain.data.mixture import open_dataset  # the dataset the loader will read: one corpus or a mixture

    train = open_dataset(cfg.data.path, cfg.data.mix, "train")
    if train.vocab_size > cfg.model.vocab_size:
        raise NdtrainError(f"the data's tokenizer has {train.vocab_size} tokens but model.vocab_size is "
                           f"{cfg.model.vocab_size}; raise model.vocab_size")
    seq = cfg.data.seq_len
    if train.num_samples(seq) == 0:
        raise ConfigError("data.seq_len", f"{train.describe()}: the train split has {len(train):,} tokens, fewer "
                                          f"than one sample of seq_len + 1 = {seq + 1}")
    t = cfg.train
    if t.val_interval > 0 and t.val_batches > 0:
        val = open_dataset(cfg.data.path, cfg.data.mix, "val")
        have, need = val.num_samples(seq), t.val_batches * t.val_batch_size
        if have < need:
            raise ConfigError("train.val_batches", f"{t.val_batches} batches of {t.val_batch_size} sequences of "
                                                   f"{seq} tokens need {need} validation samples, but the validation "
                                                   f"split of {val.describe()} has {have}; lower train.val_batches or "
                                                   f"train.val_batch_size (or set train.val_interval=0), or prepare "
                                                   f"with a larger --val-fraction")


def resume_target(spec: str) -> Path | None:
    """The checkpoint an explicit `checkpoint.resume` path points at (newest under a run or
    checkpoints directory), checked for shape but not yet for integrity; None for ''/'auto'."""
    from ndtrain.train.checkpoint import MARKER, TRAIN_STATE, list_checkpoints, not_a_directory

    if spec in ("", "auto"):
        return None
    path = Path(spec)
    if not path.exists():
        raise ConfigError("checkpoint.resume", f"{path} does not exist")
    if not path.is_dir():
        raise ConfigError("checkpoint.resume", f"{path}: {not_a_directory(path)}")
    if (path / MARKER).exists() or (path / TRAIN_STATE).exists():
        return path
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise ConfigError("checkpoint.resume", f"{path} is not a checkpoint and holds none (no step_XXXXXXXX/ with "
                                           f"a COMPLETE marker, nor checkpoints/)")


def check_resume(cfg) -> None:
    from ndtrain.train.checkpoint import model_mismatch, read_train_state

    target = resume_target(cfg.checkpoint.resume)
    if target is None or not (target / "train_state.json").exists():
        return  # an unmarked directory: resume() names what is missing
    problem = model_mismatch(cfg.model, read_train_state(target), cfg.checkpoint.allow_model_change)
    if problem:
        raise NdtrainError(f"checkpoint {target} {problem}")


def check_all(cfg) -> None:
    check_data(cfg)
    check_resume(cfg)
