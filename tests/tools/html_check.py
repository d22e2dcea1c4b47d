"""Validate a report's HTML without a browser (CI has none): every <img> is an embedded PNG that
decodes, and nothing points outside the file. Shared by the report tests and
scripts/report_in_browser.py."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser
from pathlib import Path


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs: list[dict] = []
        self.urls: list[str] = []  # every src/href/action/poster/data attribute value
        self.scripts = 0
        self.links = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        if tag == "script":
            self.scripts += 1
        if tag == "link":
            self.links += 1
        for key in ("src", "href", "action", "poster", "data", "srcset"):
            if key in a and a[key] is not None:
                self.urls.append(a[key])


def check_report_html(path: Path) -> list[tuple[int, int]]:
    """Assert the report is self-contained; returns each image's (width, height)."""
    from PIL import Image

    text = Path(path).read_text(encoding="utf-8")
    c = _Collector()
    c.feed(text)
    assert c.imgs, "the report has no images"
    assert c.scripts == 0 and c.links == 0, "the report loads scripts or stylesheets"
    assert all(u.startswith("data:image/png;base64,") for u in c.urls), [u[:60] for u in c.urls]
    # No other way of reaching the network: CSS url()/@import, or any absolute URL in the text.
    assert not re.search(r"url\(|@import|https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I)
    sizes = []
    for img in c.imgs:
        data = base64.b64decode(img["src"].split(",", 1)[1], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        im = Image.open(io.BytesIO(data))
        im.load()  # decodes every pixel: a truncated or corrupt PNG raises here
        assert im.width > 100 and im.height > 100
        assert img.get("alt")
        sizes.append(im.size)
    return sizes
