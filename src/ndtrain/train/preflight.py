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


# The fewest validation tokens a fitted run evaluates (at least one window, at most what the
# config asked for): below it, a validation loss says too little to be worth a line in the metrics.
VAL_FLOOR_TOKENS = 1024


def val_floor(seq_len: int, need: int) -> int:
    """The fewest validation windows of `seq_len` tokens a run asking for `need` is fitted to."""
    return min(need, max(1, -(-VAL_FLOOR_TOKENS // seq_len)))


def fit_to_data(cfg, pinned: dict | None = None) -> tuple:
    """`cfg` fitted to the data it names: (a fitted copy, one line per change). The rule:
    - model.vocab_size rises to the data's tokenizer size where the config's is smaller (a config
      file's, or its preset's); it never shrinks, so a run that trained before trains alike;
    - validation takes what the split holds where it holds fewer windows than val_batches x
      val_batch_size: val_batch_size down to the windows held, then val_batches = held //
      val_batch_size; below val_floor() windows (VAL_FLOOR_TOKENS tokens) nothing fits and
      check_data refuses it.
    A key given on the command line (`pinned`, parse_overrides' form) is what the user asked for
    and is never fitted: check_data refuses it where the data cannot hold it. Data that cannot be
    read is left to check_data to name."""
    import copy

    from ndtrain.data.mixture import open_dataset

    pinned = pinned or {}
    try:
        train = open_dataset(cfg.data.path, cfg.data.mix, "train")
    except NdtrainError:
        return cfg, []
    fitted, notes = copy.deepcopy(cfg), []
    if train.vocab_size > cfg.model.vocab_size and "vocab_size" not in pinned.get("model", {}):
        fitted.model.vocab_size = train.vocab_size
        notes.append(f"model.vocab_size {cfg.model.vocab_size} -> {train.vocab_size}, the size of the tokenizer of "
                     f"{train.describe()} (a --model.vocab_size given on the command line is kept)")
    t, seq = fitted.train, cfg.data.seq_len
    if t.val_interval > 0 and t.val_batches > 0 and not {"val_batches", "val_batch_size"} & set(pinned.get("train", {})):
        have, need = open_dataset(cfg.data.path, cfg.data.mix, "val").num_samples(seq), t.val_batches * t.val_batch_size
        if val_floor(seq, need) <= have < need:
            size = min(t.val_batch_size, have)
            notes.append(f"validation {t.val_batches} x {t.val_batch_size} -> {have // size} x {size} windows of {seq} "
                         f"tokens (train.val_batches x train.val_batch_size): the validation split of "
                         f"{train.describe()} holds {have}; prepare with a larger --val-fraction for more")
            t.val_batches, t.val_batch_size = have // size, size
    return fitted, notes


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def small_split_note(manifest: dict, configs: Path) -> str | None:
    """One line where the validation split holds fewer windows than a shipped config (configs/*.toml,
    in a clone) evaluates: `ndtrain train` then fits validation down to what the split holds, or
    refuses below val_floor(). None where every config fits, or none is found."""
    import tomllib

    from ndtrain.config import DataConfig, TrainConfig

    val_tokens = sum(p["val"][1] - p["val"][0] for p in manifest["parts"])
    short = []  # (tokens needed, name, windows needed, seq_len, windows held)
    for path in sorted(configs.glob("*.toml")) if configs.is_dir() else ():
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
        t, d = {**vars(TrainConfig()), **raw.get("train", {})}, {**vars(DataConfig()), **raw.get("data", {})}
        seq, need = d["seq_len"], t["val_batches"] * t["val_batch_size"]
        have = max(0, (val_tokens - 1) // seq)
        if t["val_interval"] > 0 and need > have:
            short.append((need * seq + 1, path.name, need, seq, have))
    if not short:
        return None
    tokens, name, need, seq, have = min(short)
    refused = [n for _, n, nd, sq, h in short if h < val_floor(sq, nd)]
    fitted = [n for _, n, _, _, _ in short if n not in refused]
    fraction = 1.5 * tokens / max(1, manifest["num_tokens"])  # documents are drawn: a margin over the exact share
    said = ([f"`ndtrain train` evaluates the windows it holds for {_names(fitted)}, and says so"] if fitted else []) + (
        [f"refuses {_names(refused)} (fewer than {VAL_FLOOR_TOKENS:,} tokens of validation; --train.val_interval=0 trains without "
         f"validation)"] if refused else [])
    return (f"note: the validation split ({val_tokens:,} tokens) is smaller than {len(short)} of the shipped configs "
            f"evaluate (configs/{name}: {need} windows of {seq} tokens, {have} held): {'; it '.join(said)}"
            + (f"; --val-fraction {fraction:.2g} would hold {name}'s" if fraction < 0.5 else ""))


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
