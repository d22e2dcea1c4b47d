"""`ndtrain report` on inputs it did not expect, and beside files it did not write: a metrics
row with a string where a number belongs is refused by file and line; a user's own PNG of a
figure's name survives byte for byte; overlaid runs' checkpoint markers carry their run's colour."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from ndtrain.errors import NdtrainError
from ndtrain.tools import report_plots
from ndtrain.tools.report import build_report
from ndtrain.tools.run_data import read_run


def _train(step: int, t: float, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0,
            "mfu": 0.2, "step_time_s": 0.5, "tokens_seen": 100 * step, "peak_memory_mb": 500.0, "time": t, **extra}


def _run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _with_saves(path: Path) -> Path:
    rows = [{"step": 0, "event": "start", "attempt": 0, "world": 1, "time": 0.0}] + [_train(s, s) for s in range(1, 7)]
    rows += [{"step": s, "checkpoint_mode": "sync", "checkpoint_stall_s": 0.1, "time": s + 0.2} for s in (2, 4, 6)]
    return _run(path, rows)


@pytest.mark.parametrize("key, value", [("loss", "abc"), ("time", "yesterday"), ("step_time_s", [1]),
                                        ("tokens_seen", True)])
def test_a_non_number_where_a_number_belongs_is_refused_by_file_and_line(tmp_path, key, value):
    rows = [_train(1, 1.0), _train(2, 2.0), {**_train(3, 3.0), key: value}]
    run = _run(tmp_path / "run", rows)
    with pytest.raises(NdtrainError, match=rf"metrics\.jsonl, line 3: '{key}' is .*not a number"):
        read_run(run)
    with pytest.raises(NdtrainError, match=r"line 3"):
        build_report([str(run)], tmp_path / "r.html")
    assert not list(tmp_path.glob("r.html")) + list(tmp_path.glob("r-*.png"))


def test_a_users_file_of_a_figures_name_survives_byte_for_byte(tmp_path):
    run = _with_saves(tmp_path / "run")
    mine = tmp_path / "myrep-loss.png"
    mine.write_bytes(b"\x89PNG my own picture")
    with pytest.raises(NdtrainError, match=r"myrep-loss\.png exists and is not a figure of the report"):
        build_report([str(run)], tmp_path / "myrep.html")
    assert mine.read_bytes() == b"\x89PNG my own picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myrep-loss.png", "run"]  # nothing drawn, nothing left

    # The report's own figures it replaces; one the user changed since is theirs again.
    out, pngs = build_report([str(run)], tmp_path / "ours.html")
    assert build_report([str(run)], out)[1] == pngs
    pngs[0].write_bytes(pngs[0].read_bytes() + b"edited")
    edited = pngs[0].read_bytes()
    with pytest.raises(NdtrainError, match=rf"{pngs[0].name} exists and is not a figure"):
        build_report([str(run)], out)
    assert pngs[0].read_bytes() == edited
    pngs[0].write_bytes(edited[:-len(b"edited")])
    # A figure the earlier report had and this one does not draw goes with the earlier report:
    # the files beside --out are always the figures the HTML shows.
    stale = out.with_name("ours-moe.png")
    stale.write_bytes(b"\x89PNG an earlier report's MoE figure")
    html = out.read_text()
    out.write_text(html.replace("</body>", '<img src="data:image/png;base64,'
                                + base64.b64encode(stale.read_bytes()).decode() + '"></body>'))
    assert build_report([str(run)], out)[1] == pngs and not stale.exists()
    # Figures beside a report that is gone are no longer known to be the report's.
    out.unlink()
    with pytest.raises(NdtrainError, match=r"is not a figure of the report"):
        build_report([str(run)], out)


def test_overlaid_runs_checkpoint_markers_take_their_runs_colour(tmp_path, monkeypatch):
    runs = [read_run(_with_saves(tmp_path / name)) for name in ("a", "b")]
    figures = []
    monkeypatch.setattr(report_plots, "_save", lambda fig, path: figures.append(fig) or path)
    report_plots.timeline(runs, tmp_path / "t.png")
    (ax,) = figures[0].axes
    saves = {(2, 4, 6): []}
    for c in ax.collections:
        steps = tuple(int(y) for y in c.get_offsets()[:, 1])
        if len(steps) == 1 and steps[0] in (2, 4, 6) and c.get_paths():
            saves[(2, 4, 6)].append(tuple(round(float(x), 3) for x in c.get_facecolors()[0][:3]))
    want = {tuple(round(float(x), 3) for x in report_plots.COLORS[i]) for i in range(2)}
    assert set(saves[(2, 4, 6)]) == want and len(saves[(2, 4, 6)]) == 6, saves
    figures.clear()
    report_plots.timeline(runs[:1], tmp_path / "t.png")  # one run: saves in the legend's green
    colours = {tuple(c.get_facecolors()[0][:3]) for c in figures[0].axes[0].collections}
    assert report_plots.matplotlib.colors.to_rgb(report_plots.MARKS["checkpoint"][0]) in colours


def test_a_memory_only_rank_row_draws_memory_and_no_empty_spread(tmp_path):
    rows = [_train(s, s) for s in (1, 2, 3)] + [{"step": 3, "rank_peak_memory_mb": [410.0, 395.0], "time": 3.1}]
    run = read_run(_run(tmp_path / "run", rows))
    assert report_plots.per_rank_memory(run) == [410.0, 395.0]
    assert report_plots.stragglers([run], tmp_path / "s.png") is None and not (tmp_path / "s.png").exists()
