"""The report in a real browser: headless Chromium loads it with no console error and renders
every image. Skips where Chromium or websocket-client is missing (CI has no browser); the HTML
itself is validated without a browser in test_report.py."""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "report_in_browser.py"


def _script():
    spec = importlib.util.spec_from_file_location("report_in_browser", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


browser = _script()
pytestmark = [
    pytest.mark.skipif(browser.find_chromium() is None, reason="no chromium on PATH (apt-get install -y chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("websocket") is None, reason="websocket-client not installed"),
]


@pytest.mark.timeout(180)
def test_report_renders_in_headless_chromium(tmp_path):
    from ndtrain.tools.report import build_report

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "event": "start", "attempt": 0, "world": 2, "layout": "dp_shard=2", "time": 0.0}]
    rows += [{"step": s, "loss": 5 - 0.2 * s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 900.0 + s, "mfu": 0.2,
              "step_time_s": 0.4, "tokens_seen": 512 * s, "peak_memory_mb": 400.0 + s, "time": float(s)}
             for s in range(1, 11)]
    rows += [{"step": 10, "rank_busy_s": [0.3, 0.35], "rank_peak_memory_mb": [410.0, 420.0], "time": 10.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html, pngs = build_report([str(run)], tmp_path / "report.html")
    result = browser.check_page(html, screenshot=tmp_path / "shot.png")
    assert result["problems"] == []
    assert len(result["images"]) == len(pngs) == 6
    assert all(i["w"] == 1000 and i["h"] > 300 for i in result["images"])
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The check has teeth: a corrupt image and a console error are both reported.
    # (A truncated PNG still shows its top rows in Chromium; test_report.py decodes every pixel.)
    good = base64.b64encode(pngs[0].read_bytes()).decode()
    broken = html.read_text().replace(good, base64.b64encode(b"not a png" * 100).decode(), 1)
    broken = broken.replace("</body>", "<script>console.error('boom')</script></body>")
    bad = tmp_path / "bad.html"
    bad.write_text(broken)
    problems = browser.check_page(bad)["problems"]
    assert any("did not render" in p for p in problems) and any("boom" in p for p in problems), problems
