"""A run resumed with another train.steps: the learning rate each step takes under each
optimizer.extend choice, the one line saying so, and a second resume keeping the schedule the
checkpoint recorded. The schedule's arithmetic is checked on its own first (no training), then
across real one-process resumes of the debug model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from ndtrain.config import OptimizerConfig, load_config
from ndtrain.train.optim import EXTEND, extend_schedule, lr_at

# A run of 12 steps saved at step 6, resumed for 24: warmup 2, cosine to 0.1 x lr.
LR, RATIO, WARMUP, BEFORE, AT, NOW = 1e-2, 0.1, 2, 12, 6, 24


def _opt(extend: str, schedule: str = "cosine") -> OptimizerConfig:
    return OptimizerConfig(lr=LR, min_lr_ratio=RATIO, warmup_steps=WARMUP, schedule=schedule, extend=extend)


def _resumed(extend: str, at: int = AT, schedule: str = "cosine"):
    """(the progress after the extension, its line) of a run of BEFORE steps resumed at `at` for NOW."""
    cfg = SimpleNamespace(optimizer=_opt(extend, schedule), train=SimpleNamespace(steps=NOW))
    progress = SimpleNamespace(step=at, lr_schedule={"steps": BEFORE, "segment": None})
    return cfg, progress, extend_schedule(cfg, progress)


def _lrs(cfg, progress, steps) -> list[float]:
    return [lr_at(s, cfg.optimizer, cfg.train.steps, progress.lr_schedule["segment"]) for s in steps]


def _cosine(k: int, length: int, peak: float) -> float:
    floor = LR * RATIO
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, k / length)))


def test_without_a_segment_the_schedule_is_the_configs():
    opt = _opt("stretch")
    assert lr_at(0, opt, 10) == pytest.approx(LR / 2)
    assert lr_at(1, opt, 10) == pytest.approx(LR)
    assert lr_at(6, opt, 10) == pytest.approx(_cosine(4, 8, LR))
    assert lr_at(10, opt, 10) == pytest.approx(LR * RATIO) == lr_at(50, opt, 10)


def test_each_choice_of_extend():
    old = [lr_at(s, _opt("stretch"), BEFORE) for s in range(NOW)]
    # stretch: a fresh run of NOW steps; the rate jumps up at the resume step
    cfg, progress, line = _resumed("stretch")
    assert _lrs(cfg, progress, range(AT, NOW)) == [lr_at(s, cfg.optimizer, NOW) for s in range(AT, NOW)]
    assert _lrs(cfg, progress, [AT])[0] > old[AT] * 1.3
    assert line.startswith(f"train.steps {BEFORE} -> {NOW} on resume at step {AT}: optimizer.extend = \"stretch\"")
    # keep: the old curve, then its final rate
    cfg, progress, line = _resumed("keep")
    assert _lrs(cfg, progress, range(AT, NOW)) == pytest.approx(old[AT:])
    assert _lrs(cfg, progress, range(BEFORE, NOW)) == pytest.approx([LR * RATIO] * (NOW - BEFORE))
    # decay: no jump, a cosine from the old rate at AT to the floor at NOW
    cfg, progress, line = _resumed("decay")
    got = _lrs(cfg, progress, range(AT, NOW + 1))
    assert got[0] == pytest.approx(old[AT])
    assert got == pytest.approx([_cosine(k, NOW - AT, old[AT]) for k in range(NOW - AT + 1)])
    assert all(a > b for a, b in zip(got[:-1], got[1:]))
    # restart: warmup from AT, then the full cosine to NOW
    cfg, progress, line = _resumed("restart")
    got = _lrs(cfg, progress, range(AT, NOW + 1))
    assert got[:WARMUP] == pytest.approx([LR * (k + 1) / WARMUP for k in range(WARMUP)])
    assert got[WARMUP:] == pytest.approx([_cosine(k, NOW - AT - WARMUP, LR) for k in range(NOW - AT - WARMUP + 1)])
    for mode in EXTEND:  # each line names the choice made and the others
        line = _resumed(mode)[2]
        assert f'optimizer.extend = "{mode}"' in line and all(m in line for m in EXTEND) and "\n" not in line


def test_decay_within_the_warmup_finishes_it_first():
    cfg, progress, _ = _resumed("decay", at=1)
    got = _lrs(cfg, progress, range(1, NOW + 1))
    assert got[0] == pytest.approx(LR)  # step 1 of a 2-step warmup, as before the resume
    assert got[-1] == pytest.approx(LR * RATIO)


def test_constant_schedule_decay_and_keep_hold_the_rate():
    for mode in ("keep", "decay"):
        cfg, progress, _ = _resumed(mode, schedule="constant")
        assert _lrs(cfg, progress, range(AT, NOW)) == pytest.approx([LR] * (NOW - AT))


def test_no_change_no_line_and_the_recorded_schedule_is_kept():
    cfg, progress, line = _resumed("decay")
    segment = progress.lr_schedule["segment"]
    assert extend_schedule(cfg, progress) is None  # resumed (or rolled back) again with the same length
    assert progress.lr_schedule == {"steps": NOW, "segment": segment}
    fresh = SimpleNamespace(step=0, lr_schedule=None)
    assert extend_schedule(cfg, fresh) is None and fresh.lr_schedule == {"steps": NOW, "segment": None}


def test_extend_is_a_checked_key():
    from ndtrain.errors import ConfigError

    assert load_config(None, {"optimizer": {"extend": "decay"}}).optimizer.extend == "decay"
    with pytest.raises(ConfigError, match=r"optimizer\.extend.*stretch, keep, decay, restart"):
        load_config(None, {"optimizer": {"extend": "rewind"}})


# ---- real resumes: one process, the debug model -----------------------------------------------
def _run(corpus_dir, out, steps: int, **extra) -> dict:
    from ndtrain.train.trainer import train

    cfg = {"model": {"preset": "debug"}, "data": {"path": str(corpus_dir), "seq_len": 32},
           "optimizer": {"lr": LR, "min_lr_ratio": RATIO, "warmup_steps": WARMUP},
           "train": {"steps": steps, "global_batch": 2, "micro_batch": 2, "val_interval": 0, "sample_tokens": 0,
                     "output_dir": str(out)},
           "checkpoint": {"interval_steps": 3},
           "parallel": {"compile": False},
           "logging": {"tensorboard": False, "progress": "off"}}
    for key, value in extra.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return train(load_config(None, cfg))


def _metric_lrs(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r and "loss" in r}


@pytest.mark.timeout(600)
def test_lr_across_real_resumes(corpus_dir, tmp_path, capsys):
    """Six steps saved at step 6 (of a 6-step schedule), then resumed to 12 under each choice,
    and once more (a restart at the same length) keeping what the checkpoint recorded."""
    import shutil

    base = tmp_path / "base"
    _run(corpus_dir, base, 6)
    before = _metric_lrs(base)
    opt6 = _opt("stretch")
    assert [before[s + 1] for s in range(6)] == pytest.approx([lr_at(s, opt6, 6) for s in range(6)])
    for mode in EXTEND:
        run = tmp_path / mode
        shutil.copytree(base, run)
        capsys.readouterr()
        _run(corpus_dir, run, 12, optimizer__extend=mode, checkpoint__resume="auto")
        out = capsys.readouterr()
        said = [line for line in (out.out + out.err).splitlines() if "optimizer.extend" in line]
        assert len(said) == 1 and f"train.steps 6 -> 12 on resume at step 6" in said[0], said
        got = _metric_lrs(run)
        cfg = SimpleNamespace(optimizer=_opt(mode), train=SimpleNamespace(steps=12))
        progress = SimpleNamespace(step=6, lr_schedule={"steps": 6, "segment": None})
        extend_schedule(cfg, progress)
        want = _lrs(cfg, progress, range(6, 12))
        assert [got[s + 1] for s in range(6, 12)] == pytest.approx(want, rel=1e-6), mode
        if mode == "decay":  # no jump: step 7 learns at what step 6's schedule gave its successor
            assert got[7] == pytest.approx(lr_at(6, opt6, 6))
        if mode == "keep":  # resumed at the old schedule's end: its final rate throughout
            assert [got[s] for s in range(7, 13)] == pytest.approx([LR * RATIO] * 6)
    # A second resume of the extended run (same length, from its step-9 checkpoint) says nothing
    # and follows the schedule its checkpoint recorded.
    run = tmp_path / "restart"
    first = _metric_lrs(run)
    shutil.rmtree(run / "checkpoints" / "step_00000012")
    capsys.readouterr()
    _run(corpus_dir, run, 12, optimizer__extend="restart", checkpoint__resume="auto")
    out = capsys.readouterr()
    assert "optimizer.extend" not in out.out + out.err
    again = _metric_lrs(run)
    assert [again[s] for s in (10, 11, 12)] == pytest.approx([first[s] for s in (10, 11, 12)], rel=1e-6)
