"""Open an `ndtrain report` page in headless Chromium and check it the way a reader sees it: the
page loads, the console stays free of errors, every image decodes (naturalWidth > 0). Saves a
full-page screenshot.

    apt-get install -y chromium        # Debian's package; nothing is downloaded at run time
    .venv/bin/python scripts/report_in_browser.py report.html --screenshot docs/report_screenshot.png

Talks to Chromium over the DevTools protocol (websocket-client, in the `test` extra). Exit 0
when the page is clean, 1 with the problems listed otherwise. tests/tools/test_report_browser.py
runs it when Chromium is installed and skips otherwise (CI has no browser).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]
IMAGES_JS = ("JSON.stringify(Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, "
             "w: i.naturalWidth, h: i.naturalHeight})))")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


class DevTools:
    """The few DevTools calls this check needs, over one page's websocket."""

    def __init__(self, ws_url: str, timeout: float):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=timeout)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(e.get("method") == method for e in self.events):
                return True
            self.events.append(json.loads(self.ws.recv()))
        return False

    def close(self) -> None:
        self.ws.close()


def _port(profile: Path, proc: subprocess.Popen, timeout: float) -> int:
    end = time.monotonic() + timeout
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < end:
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError("chromium did not open its DevTools port")


def check_page(html: Path, screenshot: Path | None = None, chromium: str | None = None,
               timeout: float = 60.0, width: int = 1200) -> dict:
    """Load `html`; returns {"problems": [...], "images": [...], "title": ...}."""
    chromium = chromium or find_chromium()
    if chromium is None:
        raise RuntimeError("no chromium on PATH (apt-get install -y chromium)")
    url = Path(html).resolve().as_uri()
    # Chromium's helper processes may still write into the profile as it exits: ignore that on cleanup.
    with tempfile.TemporaryDirectory(prefix="ndtrain-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},900",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = _port(Path(profile), proc, timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            dt = DevTools(page["webSocketDebuggerUrl"], timeout)
            try:
                for domain in ("Page", "Runtime", "Log"):
                    dt.call(f"{domain}.enable")
                dt.call("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1,
                        mobile=False)
                dt.events.clear()
                dt.call("Page.navigate", url=url)
                loaded = dt.wait_for("Page.loadEventFired", timeout)
                images = json.loads(dt.call("Runtime.evaluate", expression=IMAGES_JS,
                                            returnByValue=True)["result"]["value"])
                title = dt.call("Runtime.evaluate", expression="document.title", returnByValue=True)["result"]["value"]
                problems = [] if loaded else ["the page never fired its load event"]
                for e in dt.events:
                    m, p = e.get("method"), e.get("params", {})
                    if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                        problems.append("console error: " + " ".join(str(a.get("value", a.get("description")))
                                                                     for a in p.get("args", [])))
                    elif m == "Runtime.exceptionThrown":
                        problems.append(f"exception: {p['exceptionDetails'].get('text')}")
                    elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                        problems.append(f"{p['entry']['source']} error: {p['entry']['text']}")
                if not images:
                    problems.append("the page has no images")
                problems += [f"image {i['alt']!r} did not render (naturalWidth {i['w']})" for i in images
                             if not i["complete"] or i["w"] <= 0]
                if screenshot is not None:
                    size = dt.call("Page.getLayoutMetrics")["cssContentSize"]
                    shot = dt.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                                   clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1})
                    Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
            finally:
                dt.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"problems": problems, "images": images, "title": title}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("html", type=Path)
    p.add_argument("--screenshot", type=Path, help="write a full-page PNG here")
    p.add_argument("--chromium", help="browser binary (default: chromium on PATH)")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    result = check_page(args.html, args.screenshot, args.chromium, args.timeout)
    print(f"{args.html}: title {result['title']!r}, {len(result['images'])} images: "
          + ", ".join(f"{i['alt']} {i['w']}x{i['h']}" for i in result["images"]))
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    if args.screenshot:
        print(f"screenshot: {args.screenshot}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
