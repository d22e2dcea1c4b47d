"""Every collective around checkpoint files runs on the checkpointer's own group, whose timeout is
sized for file I/O (manager.CKPT_TIMEOUT_S), not on the training group, sized for compute
(train.timeout_s): a synchronous save (async = false, the final save, a stop signal's save) and
a resume, as well as an async save."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

_COLLECTIVES = ("barrier", "all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
                "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier")


def _timeout_s(group) -> float:
    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _record(monkeypatch, seen: list):
    """Wraps torch.distributed's collectives: each call appends (name, its group's timeout)."""
    for name in _COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, _timeout_s(kwargs.get("group"))))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)


def _rank(base: dict, run: str, async_: bool) -> list:
    from ckpt_helpers import cfg_of, job

    from ndtrain.train.trainer import Trainer

    monkeypatch = pytest.MonkeyPatch()
    cfg = cfg_of(job(base, run, train={"steps": 4, "timeout_s": 60},
                     checkpoint={"keep_last": 1, "async": async_}))
    trainer = Trainer(cfg, run_dir=None, log=False)
    ck = trainer.checkpointer(run, cfg)
    ck._info = lambda text: None
    saves: list = []
    try:
        trainer.train_step()
        _record(monkeypatch, saves)
        ck.save()  # sync unless async_
        monkeypatch.undo()
        trainer.train_step()
        _record(monkeypatch, saves)
        ck.save(final=True)  # always sync: the final save and a stop signal's
        ck.finish()
        monkeypatch.undo()
        trainer.close()
        other = Trainer(cfg, run_dir=None, log=False)
        ck2 = other.checkpointer(run, cfg)
        resumes: list = []
        _record(monkeypatch, resumes)
        path = ck2.resume("auto")
        monkeypatch.undo()
        assert path.name == "step_00000002" and other.step == 2
        other.close()
    finally:
        monkeypatch.undo()
    return [saves, resumes]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("async_", [False, True])
def test_checkpoint_collectives_use_the_io_group(async_, parity_base, tmp_path, hang_deadline):
    from ckpt_helpers import job

    from ndtrain.parallel.launch import run_ranks
    from ndtrain.train.checkpoint.manager import CKPT_TIMEOUT_S

    results = run_ranks(2, _rank, job(parity_base), str(tmp_path / "run"), async_, timeout_s=hang_deadline(60))
    for saves, resumes in results:
        # DCP's own plan exchange and ours (barriers, the error check, the retention check) ...
        names = {name for name, _ in saves}
        assert {"barrier", "all_reduce"} <= names and ({"gather_object", "all_gather_object"} & names), names
        assert {"broadcast_object_list", "all_gather_object"} <= {name for name, _ in resumes}
        # ... all on a group whose timeout is the checkpointer's, never the training group's 60 s
        timeouts = {t for _, t in saves + resumes}
        assert timeouts == {CKPT_TIMEOUT_S}, sorted(set(saves + resumes))
    assert timedelta(seconds=CKPT_TIMEOUT_S) > timedelta(seconds=60)
