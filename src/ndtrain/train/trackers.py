"""Experiment trackers: TensorBoard, Weights & Biases (offline by default) and MLflow (a file
store in the run directory by default). Rank 0's MetricsLogger owns them; nothing else logs.

A restarted run continues the same tracked run: the W&B run id and the MLflow run id are kept
in `<run dir>/trackers.json`, written by the first attempt and read by every later one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import uuid
from pathlib import Path

from ndtrain.errors import NdtrainError

STATE_FILE = "trackers.json"
# tracker -> (module to import, the extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "the default dependencies"), "wandb": ("wandb", "ndtrain[wandb]"),
            "mlflow": ("mlflow", "ndtrain[mlflow]")}


def enabled(logging_cfg) -> list[str]:
    """The trackers to open: `trackers`, less TensorBoard when the older `tensorboard = false` says so."""
    return [t for t in logging_cfg.trackers if t != "tensorboard" or logging_cfg.tensorboard]


def check_installed(logging_cfg) -> None:
    """Fail before any work when a configured tracker's package is missing (every rank calls
    this, so no rank is left waiting in a collective for one that raised)."""
    for name in enabled(logging_cfg):
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise NdtrainError(f"logging.trackers includes {name!r} but the {module} package is not installed; "
                               f"install {extra} (pip install '{extra}') or remove it from [logging] trackers")


def scalars(row: dict) -> dict[str, float]:
    """The numeric entries of a metrics row (lists such as per-expert loads and strings are not
    scalars; bools are logged as 0/1)."""
    return {k: float(v) for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}


# Row entries that are wall-clock times (Unix seconds; `time` itself is each record's own time).
# A tracker gets them as seconds since the run's start, under a name that says so: TensorBoard
# keeps a scalar as float32, which holds a Unix time of today only to the nearest 128 s.
WALL_CLOCK_KEYS = ("worker_started", "imported")


def since_start(values: dict[str, float], start: float | None) -> dict[str, float]:
    if start is None:
        return values
    return {(f"{k}_since_start_s" if k in WALL_CLOCK_KEYS else k): (v - start if k in WALL_CLOCK_KEYS else v)
            for k, v in values.items()}


def run_start(run_dir: Path) -> float:
    """When the run began: its first metrics row's time (the first attempt's; later attempts
    read the same), or now for a run that has logged nothing yet."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as f:
            first = json.loads(f.readline()).get("time")
    except (OSError, ValueError, AttributeError):
        first = None
    return float(first) if isinstance(first, (int, float)) and not isinstance(first, bool) else time.time()


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


class RunState:
    """The ids that let a restart continue the same tracked runs."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / STATE_FILE
        try:
            self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        except (OSError, ValueError):
            self.data = {}  # a torn write from a killed attempt: start new tracked runs

    def get(self, key: str) -> dict:
        return self.data.get(key, {})

    def put(self, key: str, value: dict) -> None:
        from ndtrain.train.run_files import write_run_file

        self.data[key] = value
        write_run_file(self.path, json.dumps(self.data, indent=1))  # by rename, never through a link


class TensorBoardTracker:

    """TensorBoard's event file, written on the training thread, each call's records in one
    unbuffered write. torch's SummaryWriter writes from a thread of its own: a full disk there was
    that thread's traceback, then a line without the path. Here it is an OSError in `log`, which
    the MetricsLogger reports with `path` and `pending` (the bytes it was writing)."""

    start: float | None = None  # the run's start (run_start): wall-clock entries are logged since it

    def __init__(self, run_dir: Path, start_step: int):
        import socket

        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._event = Event
        directory = run_dir / "tensorboard"
        self.path, self.pending = directory, 0
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        for n in range(1000):  # a name of its own: O_EXCL, never another attempt's file
            try:
                self.fd = os.open(directory / f"{stem}.{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                continue
        self.path = directory / f"{stem}.{n}"
        events = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if start_step:  # what SummaryWriter's purge_step writes: readers drop the events a crashed
            # attempt wrote past the checkpoint this one resumed from
            events += [Event(step=start_step + 1, file_version="brain.Event:2"),
                       Event(step=start_step + 1, session_log=SessionLog(status=SessionLog.START))]
        self._write(events)

    def log(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values, now = since_start(values, self.start), time.time()
        self._write([self._event(wall_time=now, step=step, summary=Summary(value=[Summary.Value(tag=k, simple_value=v)]))
                     for k, v in values.items()])

    def _write(self, events) -> None:
        import io

        from tensorboard.summary.writer.record_writer import RecordWriter

        blob = io.BytesIO()
        records = RecordWriter(blob)  # TFRecord framing: length, CRCs, the serialized event
        for e in events:
            records.write(e.SerializeToString())
        data = memoryview(blob.getvalue())
        self.pending = len(data)
        while data:
            data = data[os.write(self.fd, data):]
        self.pending = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WandbTracker:
    start: float | None = None

    def __init__(self, run_dir: Path, cfg, config: dict, state: RunState):
        import wandb

        saved = state.get("wandb")
        run_id = saved.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(project=cfg.project, id=run_id, resume="allow", mode=cfg.wandb_mode,
                              dir=str(run_dir), name=run_dir.name, config=config,
                              settings=wandb.Settings(silent=True, console="off"))
        # Our step, not W&B's internal one, is the x axis: after a restart from a checkpoint the
        # steps repeat, which W&B's own step (strictly increasing) would drop.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if not saved:
            state.put("wandb", {"id": run_id, "project": cfg.project, "mode": cfg.wandb_mode})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **since_start(values, self.start)})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    start: float | None = None

    def __init__(self, run_dir: Path, cfg, config: dict, state: RunState):
        uri = cfg.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; a local, offline store is the point here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.metric_cls = Metric
        saved = state.get("mlflow")
        self.run_id = saved.get("run_id") if saved.get("uri") == uri else None
        if self.run_id:
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            exp = self.client.get_experiment_by_name(cfg.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.project)
            self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
            params = [Param(k, v[:6000]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            state.put("mlflow", {"run_id": self.run_id, "uri": uri, "experiment": cfg.project})

    def log(self, step: int, values: dict[str, float]) -> None:
        ms = int(time.time() * 1000)
        metrics = [self.metric_cls(k, v if math.isfinite(v) else float("nan"), ms, step)
                   for k, v in since_start(values, self.start).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(run_dir: Path, logging_cfg, config: dict, start_step: int) -> list:
    check_installed(logging_cfg)
    state = RunState(run_dir)
    out = []
    for name in enabled(logging_cfg):
        if name == "tensorboard":
            out.append(TensorBoardTracker(run_dir, start_step))
        elif name == "wandb":
            out.append(WandbTracker(run_dir, logging_cfg, config, state))
        elif name == "mlflow":
            out.append(MlflowTracker(run_dir, logging_cfg, config, state))
    start = run_start(run_dir)
    for tracker in out:
        tracker.start = start
    return out
