"""`ndtrain report`: the timeline of a restarted run, real runs drawn into a self-contained HTML
file (checked without a browser), several runs overlaid, and bad input refused with one line."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from html_check import check_report_html
from ndtrain.config import load_config
from ndtrain.tools.report import build_report, header_rows
from ndtrain.tools.run_data import read_run


def _write_rows(path: Path, rows: list, tail: str = "") -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def _train_row(step: int, t: float, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
            "mfu": 0.2, "step_time_s": 0.5, "tokens_seen": 100 * step, "peak_memory_mb": 500.0, "time": t, **extra}


def test_timeline_of_a_crashed_restarted_and_rolled_back_live_run(tmp_path):
    rows = [{"step": 0, "event": "start", "attempt": 0, "world": 2, "layout": "dp_shard=2", "time": 0.0}]
    rows += [_train_row(s, s) for s in range(1, 7)]  # attempt 0 reaches step 6, then dies
    rows += [{"step": 4, "checkpoint_mode": "sync", "checkpoint_stall_s": 0.1, "checkpoint_total_s": 0.1, "time": 4.5}]
    rows += [{"step": 4, "event": "restart", "attempt": 1, "world": 1, "layout": "single", "time": 20.0}]
    rows += [_train_row(s, 16 + s) for s in range(5, 9)]  # steps 5, 6 again, then 7, 8
    rows += [_train_row(9, 26, skipped=True), {"step": 9, "event": "nonfinite", "time": 26.1},
             {"step": 8, "event": "rollback", "to": "step_00000008", "skip_window": [36, 40], "time": 27.0}]
    rows += [_train_row(s, 20 + s) for s in range(9, 11)]
    _write_rows(tmp_path / "run", rows, tail='{"step": 11, "loss": 4.')  # a row being written
    run = read_run(tmp_path / "run")
    assert [r["step"] for r in run.train] == list(range(1, 11))
    assert not any(r.get("skipped") for r in run.train)  # the skipped step 9 was rolled back and redone
    assert sorted(r["step"] for r in run.superseded) == [5, 6, 9]
    assert run.train[4]["time"] == 21  # step 5 as the restarted attempt logged it
    assert len(run.restarts) == 1 and run.count("rollback") == 1 and run.unreadable_lines == 1
    assert run.world() == 1 and run.layout() == "single" and not run.finished
    table = dict(header_rows([run], now=40.0))
    assert table["restarts / rollbacks / skipped steps"] == ["1 / 1 / 0"]
    assert table["status"][0].startswith("not finished: step 10")
    assert table["unreadable metrics lines"][0].startswith("1 ")


def test_restart_inferred_for_runs_without_restart_rows(tmp_path):
    rows = [_train_row(s, s) for s in (1, 2, 3, 4)] + [_train_row(s, 10 + s) for s in (3, 4, 5)]
    _write_rows(tmp_path / "old", rows)
    run = read_run(tmp_path / "old")
    assert [r["step"] for r in run.train] == [1, 2, 3, 4, 5] and run.train[2]["time"] == 13
    assert [e["event"] for e in run.restarts] == ["restart (inferred)"]


def _cli(*args, hang_deadline, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ndtrain", *map(str, args)], capture_output=True, text=True,
                          timeout=hang_deadline(120), cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _train_args(corpus_dir, out, **extra) -> list[str]:
    args = {"model.preset": "debug", "data.path": corpus_dir, "data.seq_len": 64, "train.global_batch": 8,
            "train.micro_batch": 8, "train.val_interval": 3, "train.val_batches": 1, "train.sample_tokens": 0,
            "checkpoint.interval_steps": 4, "logging.progress": "off", "train.output_dir": out, **extra}
    return [f"--{k}={v}" for k, v in args.items()]


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_report_of_a_killed_and_restarted_run_overlaid_with_a_bf16_run(corpus_dir, tmp_path, monkeypatch, capsys, hang_deadline):
    from ndtrain.cli import main as cli
    from ndtrain.train.trainer import train

    run, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    # Attempt 0 is killed (SIGKILL) as step 6 starts; attempt 1 resumes from step 4's checkpoint,
    # exactly as under torchrun --max-restarts (which sets TORCHELASTIC_RESTART_COUNT, and the
    # launch's TORCHELASTIC_RUN_ID, the same for every attempt).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NDTRAIN_FAULTS": "0:0:6:step", "TORCHELASTIC_RUN_ID": "job-1"}
    killed = subprocess.run([sys.executable, "-m", "ndtrain", "train", *_train_args(corpus_dir, run, **{
        "train.steps": 8})], env=env, capture_output=True, text=True, timeout=hang_deadline(120))
    assert killed.returncode == -9, killed.stderr[-2000:]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    assert train(load_config(None, _train_args(corpus_dir, run, **{"train.steps": 8})))["steps"] == 8
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    train(load_config(None, _train_args(corpus_dir, bf16, **{"train.steps": 8, "parallel.mixed_precision": "bf16"})))

    fp32_run = read_run(run)
    assert [r["step"] for r in fp32_run.train] == list(range(1, 9)) and fp32_run.finished
    assert [r["step"] for r in fp32_run.superseded] == [5]  # logged by attempt 0, redone by attempt 1
    assert [e["attempt"] for e in fp32_run.starts] == [0, 1] and fp32_run.starts[1]["step"] == 4

    out = tmp_path / "cmp" / "report.html"
    out.parent.mkdir()
    assert cli(["report", str(run), str(bf16), "--out", str(out)]) == 0
    sizes = check_report_html(out)
    text = out.read_text()
    for name in ("loss", "throughput", "optimizer", "memory", "timeline"):
        png = out.with_name(f"report-{name}.png")
        assert base64.b64encode(png.read_bytes()).decode() in text, name  # the PNG beside it is the one embedded
    assert len(sizes) == 5  # no MoE, pipeline or per-rank rows in single-process dense runs
    assert "differs: parallel.mixed_precision" in text and "1 / 0 / 0" in text and text.count("finished") >= 2

    # The report may replace itself, and only itself.
    assert cli(["report", str(run), "--out", str(out)]) == 0
    check_report_html(out)


def _rank_train(cfg):
    from ndtrain.train.trainer import train

    return train(cfg)["steps"]


@pytest.mark.timeout(240)
def test_report_draws_pipeline_gantt_moe_load_and_per_rank_rows(corpus_dir, tmp_path, hang_deadline):
    from ndtrain.parallel.launch import run_ranks

    out = tmp_path / "run"
    cfg = load_config(None, {
        "model": {"preset": "debug-moe"}, "data": {"path": str(corpus_dir), "seq_len": 64},
        "parallel": {"pp": 2, "dp_shard": 1},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 4, "val_interval": 0, "sample_tokens": 0,
                  "straggler_window": 2, "output_dir": str(out)},
        "logging": {"progress": "off", "pipeline_trace_step": 3, "trackers": ["tensorboard", "mlflow"]}})
    assert run_ranks(2, _rank_train, cfg, timeout_s=hang_deadline(120)) == [6, 6]
    run = read_run(out)
    assert run.pipeline["step"] == 3 and len(run.pipeline["ranks"]) == 2
    assert [len(r["rank_peak_memory_mb"]) for r in run.ranks] == [2, 2, 2]
    assert all(m > 0 for r in run.ranks for m in r["rank_peak_memory_mb"])
    # Only rank 0 logs to trackers: one MLflow run.
    assert len([p for p in (out / "mlruns").glob("*/*/meta.yaml")]) == 1
    report, pngs = build_report([str(out)], tmp_path / "r.html")
    assert {p.name for p in pngs} >= {"r-memory.png", "r-stragglers.png", "r-moe.png", "r-pipeline.png"}
    assert len(check_report_html(report)) == len(pngs) == 8


def test_report_imports_no_torch(tmp_path, hang_deadline):
    _write_rows(tmp_path / "run", [_train_row(s, s) for s in range(1, 4)])
    code = ("import sys; from ndtrain.tools.report import build_report; "
            f"build_report([{str(tmp_path / 'run')!r}], {str(tmp_path / 'r.html')!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_deadline(120))
    assert proc.returncode == 0, proc.stderr
    check_report_html(tmp_path / "r.html")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_bad_input_is_one_line_exit_2_and_loses_nothing(tmp_path, capsys, hang_deadline):
    from ndtrain.cli import main as cli

    _write_rows(tmp_path / "run", [_train_row(1, 1.0)])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "mine.html").write_text("<html>my own page</html>")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "dir.html").mkdir()
    bad = tmp_path / "badcfg"
    _write_rows(bad, [_train_row(1, 1.0)])
    (bad / "config.toml").write_text("[model\n")
    before = _files(tmp_path)
    cases = [
        ([tmp_path / "missing"], tmp_path / "r.html", "run directory not found"),
        ([tmp_path / "notes"], tmp_path / "r.html", "is not a run directory"),
        ([tmp_path / "file.txt"], tmp_path / "r.html", "is not a directory"),
        ([bad], tmp_path / "r.html", "config.toml: not valid TOML"),
        ([tmp_path / "run", tmp_path / "missing"], tmp_path / "r.html", "run directory not found"),
        ([tmp_path / "run"], tmp_path / "nowhere" / "r.html", "does not exist"),
        ([tmp_path / "run"], tmp_path / "mine.html", "not an ndtrain report"),
        ([tmp_path / "run"], tmp_path / "run" / "metrics.jsonl", "must name an .html file"),
        ([tmp_path / "run"], tmp_path / "dir.html", "is a directory"),
    ]
    for dirs, out, message in cases:
        assert cli(["report", *map(str, dirs), "--out", str(out)]) == 2, (dirs, out)
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, err
    assert _files(tmp_path) == before and not (tmp_path / "r.html").exists()
    # The same through the installed command, once: one line on stderr, exit 2.
    proc = _cli("report", tmp_path / "missing", "--out", tmp_path / "r.html", hang_deadline=hang_deadline)
    assert proc.returncode == 2 and proc.stderr.strip() == f"ndtrain report: error: run directory not found: " \
        f"{tmp_path / 'missing'}"


@pytest.mark.timeout(180)
def test_auto_layout_prediction_is_recorded_and_set_against_the_measurement(parity_base, tmp_path):
    from ndtrain.train.trainer import train

    base = {k: dict(v) for k, v in parity_base.items()}
    base["parallel"] = {"auto": True}
    base["train"].update(steps=8, val_interval=0, sample_tokens=0, output_dir=str(tmp_path / "run"))
    train(load_config(None, base))  # resolves the plan itself, as `ndtrain train` does
    run = read_run(tmp_path / "run")
    assert run.auto["predicted_step_time"] > 0 and run.auto["layout"]
    measured = run.measured_step_time()  # median of steps 4..8: past the warm-up
    assert measured == sorted(r["step_time_s"] for r in run.train[3:])[2]
    (row,) = [v for k, v in header_rows([run], now=0.0) if k.startswith("planner")]
    assert f"measured {measured:.3f} s/step" in row[0] and f"predicted {run.auto['predicted_step_time']:.3f}" in row[0]


def test_unwritable_out_directory_is_refused_before_any_work(tmp_path, monkeypatch):
    # As root every directory is writable, so the permission answer is simulated.
    import ndtrain.tools.report as report
    from ndtrain.errors import NdtrainError

    _write_rows(tmp_path / "run", [_train_row(1, 1.0)])
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(report.os, "access", lambda path, mode: Path(path) != tmp_path / "ro")
    with pytest.raises(NdtrainError, match="is not writable"):
        report.build_report([str(tmp_path / "run")], tmp_path / "ro" / "r.html")
    assert list((tmp_path / "ro").iterdir()) == []
