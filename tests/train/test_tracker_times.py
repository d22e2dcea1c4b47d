"""Wall-clock entries of a metrics row reach the trackers as seconds since the run's start:
TensorBoard keeps a scalar as float32, in which two Unix times of today 6 s apart are one value."""

from __future__ import annotations

import json
import types

import numpy as np

from ndtrain.train import metrics, trackers

T0 = 1_796_000_000.0  # a Unix time of late 2026


def _scalars(run_dir) -> dict[str, float]:
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    out = {}
    for path in sorted((run_dir / "tensorboard").iterdir()):
        for record in RawEventFileLoader(str(path)).Load():  # as written: float32 simple values
            for value in Event.FromString(record).summary.value:
                out[value.tag] = value.simple_value
    return out


def test_tensorboard_gets_wall_clock_entries_since_the_run_start(tmp_path):
    assert np.float32(T0 + 100.0) == np.float32(T0 + 106.0)  # why: float32 spacing here is 128 s
    run = tmp_path / "run"
    log = metrics.MetricsLogger(run, True, 5, "off", logging_cfg=types.SimpleNamespace(trackers=["tensorboard"],
                                                                                         tensorboard=True))
    log.log({"step": 0, "event": "start", "world": 2, "time": T0})  # the run's first row: its start
    log.log({"step": 4, "event": "membership", "old_world": 3, "world": 2, "worker_started": T0 + 100.0,
             "imported": T0 + 106.0, "time": T0 + 110.0})
    log.close()
    got = _scalars(run)
    assert got["worker_started_since_start_s"] == 100.0 and got["imported_since_start_s"] == 106.0, got
    assert "imported" not in got and got["old_world"] == 3.0
    # metrics.jsonl keeps the Unix times as written (float64): the report computes with them.
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["imported"] - rows[1]["worker_started"] == 6.0


def test_a_later_attempt_counts_from_the_same_start(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "event": "start", "time": T0}) + "\n")
    assert trackers.run_start(tmp_path) == T0
    assert trackers.since_start({"imported": T0 + 7.5, "loss": 2.0}, T0) == {"imported_since_start_s": 7.5, "loss": 2.0}
    assert trackers.since_start({"imported": T0}, None) == {"imported": T0}
