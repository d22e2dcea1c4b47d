"""Experiment trackers: W&B offline and MLflow's file store receive the metrics, a killed and
restarted run continues the same tracked run, and a missing package is one clear line."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.train import trackers


def wandb_records(path: Path):
    """Records of a W&B offline transaction log (`run-<id>.wandb`): a 7-byte header, then
    LevelDB-style log blocks of 32 KiB holding framed protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_history(path: Path) -> list[dict]:
    rows = []
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item})
    return rows


def _train(corpus_dir, out: Path, env_extra: dict, hang_deadline) -> subprocess.CompletedProcess:
    args = {"model.preset": "debug", "data.path": corpus_dir, "data.seq_len": 64, "train.global_batch": 8,
            "train.micro_batch": 8, "train.steps": 8, "train.val_interval": 4, "train.val_batches": 1,
            "train.sample_tokens": 0, "checkpoint.interval_steps": 4, "logging.progress": "off",
            "logging.trackers": '["wandb","mlflow"]', "train.output_dir": out}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NDTRAIN_FAULTS": "0:0:6:step", **env_extra}
    return subprocess.run([sys.executable, "-m", "ndtrain", "train", *[f"--{k}={v}" for k, v in args.items()]],
                          env=env, capture_output=True, text=True, timeout=hang_deadline(180))


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_wandb_offline_and_mlflow_file_store_continue_the_run_after_a_restart(corpus_dir, tmp_path, hang_deadline):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    # Attempt 0 is killed as step 6 starts (after step 4's checkpoint and step 5's row); attempt 1
    # resumes from step 4, as torchrun --max-restarts would run it.
    killed = _train(corpus_dir, out, {}, hang_deadline)
    assert killed.returncode == -9, killed.stderr[-2000:]
    ids_before = json.loads((out / "trackers.json").read_text())
    done = _train(corpus_dir, out, {"TORCHELASTIC_RESTART_COUNT": "1"}, hang_deadline)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = json.loads((out / "trackers.json").read_text())
    assert ids == ids_before and ids["wandb"]["mode"] == "offline"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = {r["step"]: r["loss"] for r in rows if "loss" in r}  # the later attempt's row wins
    assert sorted(final) == list(range(1, 9))

    # MLflow: one run in the experiment holds both attempts; step 5 twice (killed, then redone).
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=ids["mlflow"]["uri"])
    exp = client.get_experiment_by_name("ndtrain")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["model.preset"] == "debug"
    history = client.get_metric_history(ids["mlflow"]["run_id"], "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert latest == pytest.approx(final, rel=1e-12)
    assert [m.step for m in client.get_metric_history(ids["mlflow"]["run_id"], "val_loss")] == [4, 8]

    # W&B offline: one directory per attempt, both for the same run id; the steps land in order.
    logs = sorted((out / "wandb").glob(f"offline-run-*-{ids['wandb']['id']}/run-{ids['wandb']['id']}.wandb"))
    assert len(logs) == 2 and len(list((out / "wandb").glob("offline-run-*"))) == 2
    first, second = (wandb_history(p) for p in logs)
    # W&B's service process writes its offline log every few seconds: a SIGKILL loses the rows it
    # still held (metrics.jsonl has every row). What did reach the disk is in order.
    steps = [r["step"] for r in first if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) <= 5
    assert [r["step"] for r in second if "loss" in r] == [5, 6, 7, 8]
    assert {r["step"]: r["loss"] for r in second if "loss" in r} == pytest.approx(
        {s: final[s] for s in range(5, 9)}, rel=1e-12)
    assert not (out / "tensorboard").exists()  # trackers = ["wandb", "mlflow"]: no TensorBoard


def test_tracker_selection_and_the_older_tensorboard_key():
    assert trackers.enabled(load_config(None, {}).logging) == ["tensorboard"]
    assert trackers.enabled(load_config(None, {"logging": {"tensorboard": False}}).logging) == []
    cfg = load_config(None, {"logging": {"trackers": ["mlflow", "tensorboard"], "tensorboard": False}})
    assert trackers.enabled(cfg.logging) == ["mlflow"]
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, {"logging": {"trackers": ["neptune"]}})
    with pytest.raises(ConfigError, match="logging.trackers"):
        load_config(None, {"logging": {"trackers": ["wandb", "wandb"]}})
    assert trackers.scalars({"step": 3, "time": 1.0, "loss": 2, "skipped": False, "event": "x",
                             "moe/layer1/tokens_per_expert": [1, 2]}) == {"loss": 2.0, "skipped": 0.0}


def test_missing_tracker_package_is_one_clear_line(monkeypatch, corpus_dir, tmp_path, hang_deadline):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec() then reports it missing
    with pytest.raises(NdtrainError, match=r"'wandb' but the wandb package is not installed.*ndtrain\[wandb\]"):
        trackers.check_installed(load_config(None, {"logging": {"trackers": ["wandb"]}}).logging)
    code = ("import sys; sys.modules['mlflow'] = None; from ndtrain.cli import main; "
            f"sys.exit(main(['train', '--data.path={corpus_dir}', '--train.output_dir={tmp_path / 'r'}', "
            "'--logging.trackers=[\"mlflow\"]', '--nproc', '2']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_deadline(120))
    assert proc.returncode == 2
    assert "mlflow package is not installed" in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert not (tmp_path / "r").exists()
