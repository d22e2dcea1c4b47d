"""Metrics a user reads: a full disk under metrics.jsonl or TensorBoard is one line with the path
and the bytes (as for checkpoints), not a writer thread's traceback; no printed ratio of a peak
(the step line, fp8's two peaks, `ndtrain report`, older runs' rows included) exceeds 100%."""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import types

import pytest

from ndtrain.errors import RunError
from ndtrain.layout.flops import mfu
from ndtrain.train import metrics, trackers

pytestmark = pytest.mark.timeout(120)


def _row(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0, "mfu": 0.25,
            "step_time_s": 0.5, "tokens_seen": 100 * step, "peak_memory_mb": 10.0, **extra}


def _no_unraisable(monkeypatch) -> list:
    """What the interpreter would print as 'Exception ignored in ...' (a file whose last flush fails)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    return seen


def test_a_full_disk_under_metrics_jsonl_is_one_line_with_path_and_bytes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    log = metrics.MetricsLogger(run, True, 5, "off")
    log.log(_row(1))
    before = (run / "metrics.jsonl").read_bytes()
    # The kernel's own ENOSPC: /dev/full fails every write, as a full disk does at the flush.
    log.file.close()
    log.file = open("/dev/full", "a", buffering=1)
    unraisable = _no_unraisable(monkeypatch)
    with pytest.raises(RunError) as info:
        log.log(_row(2))
    msg = str(info.value)
    assert "\n" not in msg and str(run / "metrics.jsonl") in msg, msg
    assert re.search(r"need [\d,]+ bytes", msg) and "MB are free" in msg and "step 2" in msg, msg
    assert info.value.exit_code == 1
    log.log(_row(3))  # the logger has stopped: nothing more, no second error
    log.close()
    import gc

    gc.collect()
    assert not unraisable, unraisable  # the dropped line is not flushed again at exit
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_full_disk_under_tensorboard_is_one_line_not_a_thread_traceback(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    run = tmp_path / "run"
    cfg = types.SimpleNamespace(trackers=["tensorboard"], tensorboard=True)
    log = metrics.MetricsLogger(run, True, 5, "off", logging_cfg=cfg)
    log.start(3)  # a resumed attempt: TensorBoard is told to drop what a crashed one wrote past step 3
    log.log(_row(4))
    tb = log.trackers[0]
    events = list(LegacyEventFileLoader(str(tb.path)).Load())  # the records as TensorBoard reads them
    assert events[0].file_version == "brain.Event:2"
    assert any(e.step == 4 and e.session_log.status == e.session_log.START for e in events)
    loss = [v.simple_value for e in events if e.step == 4 for v in e.summary.value if v.tag == "loss"]
    assert loss == [2.0]
    good = tb.path.read_bytes()
    os.close(tb.fd)
    tb.fd = os.open("/dev/full", os.O_WRONLY)
    unraisable = _no_unraisable(monkeypatch)
    threads = []
    monkeypatch.setattr("threading.excepthook", lambda args: threads.append(args))
    with pytest.raises(RunError) as info:
        log.log(_row(5))
    msg = str(info.value)
    assert "\n" not in msg and str(tb.path) in msg and re.search(r"need [\d,]+ bytes", msg), msg
    assert not threads and not unraisable
    log.close()
    assert tb.path.read_bytes() == good


def test_any_other_write_error_names_the_path(tmp_path):
    log = metrics.MetricsLogger(tmp_path / "run", True, 5, "off")

    class Broken:
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

        def fileno(self):
            raise ValueError("no descriptor")

    log.file = Broken()
    with pytest.raises(RunError, match=r"cannot write .*metrics\.jsonl: Input/output error"):
        log.log(_row(1))


def _percents(text: str) -> list[float]:
    return [float(p) for p in re.findall(r"(\d+(?:\.\d+)?)\s*%", text)]


def test_no_printed_ratio_of_a_peak_exceeds_100_percent(tmp_path, capsys):
    """A metrics path fed with a peak far below what the run does (bf16 and fp8), then `ndtrain
    report` of it, with rows an older ndtrain wrote (MFU 195.7%) appended."""
    from ndtrain.tools.report import header_rows
    from ndtrain.tools.run_data import read_run

    run = tmp_path / "run"
    log = metrics.MetricsLogger(run, True, 8, "off")
    flops = 2e12
    for step, peak in ((1, 1e12), (2, 4e12), (3, 0.5e12), (4, 1.9e12)):
        log.last_print = 0.0  # print every row
        log.log(_row(step, mfu=mfu(flops, peak), mfu_fp8=mfu(flops, peak / 2), last=step == 4))
    log.close()
    with open(run / "metrics.jsonl", "a") as f:
        for step in range(5, 9):
            f.write(json.dumps(_row(step, mfu=1.957, mfu_fp8=3.9, time=float(step))) + "\n")
    printed = capsys.readouterr().out
    assert "of bf16 peak" in printed and "fp8 peak is wrong" in printed
    table = "\n".join(f"{name}: {' | '.join(values)}" for name, values in header_rows([read_run(run)], now=10.0))
    assert "MFU" in table
    assert all(p <= 100 for p in _percents(printed + table)), printed + table
    assert 0 < min(_percents(printed))  # the plausible ones are still shown


def test_a_tracker_that_cannot_create_its_file_is_one_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    cfg = types.SimpleNamespace(trackers=["tensorboard"], tensorboard=True)
    log = metrics.MetricsLogger(run, True, 5, "off", logging_cfg=cfg)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(run / "tensorboard"))

    monkeypatch.setattr(trackers, "open_trackers", full)
    monkeypatch.setattr(metrics, "open_trackers", full)
    with pytest.raises(RunError, match=r"no space left on the device of .*tensorboard"):
        log.start(0)
