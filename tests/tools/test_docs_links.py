"""Every relative link in README.md, docs/*.md and docs/results/*.md lands somewhere.

The README is a front page that sends readers to docs/ pages, and sections move between pages;
a link left pointing at the old place lands on a 404 or at the top of a page, which no one
notices until a newcomer follows it. These tests read the Markdown, nothing else: a link's
file must exist (relative to the page that holds it), and a `#anchor` into a Markdown page must
name one of its headings, as GitHub spells heading ids.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        mark = re.match(r"^\s*(```+|~~~+)", line)
        if mark:
            if fence is None:
                fence = mark.group(1)[0] * 3
            elif mark.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's heading id: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text stays
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    ids = set()
    for _, line in _prose(path.read_text()):
        match = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(f"{base}-{n}" if n else base)
    return ids


def broken_links(pages: list[Path], root: Path = ROOT) -> tuple[list[str], int]:
    """('page:line: target (why)', ...) and how many relative links were checked."""
    broken, checked, cache = [], 0, {}
    for page in pages:
        for n, line in _prose(page.read_text()):
            for target in LINK.findall(CODE_SPAN.sub("", line)):  # `[x](y)` in code is no link
                if EXTERNAL.match(target):
                    continue
                checked += 1
                path_part, _, anchor = target.partition("#")
                where = f"{page.relative_to(root)}:{n}: {target}"
                dest = (page.parent / path_part).resolve() if path_part else page
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        broken.append(f"{where} (no heading with id '{anchor}' in {dest.name})")
    return broken, checked


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken, checked = broken_links(_pages())
    assert checked > 50, f"only {checked} relative links found: the parser has stopped seeing them"
    assert not broken, "links that land nowhere:\n" + "\n".join(broken)


def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path):
    # The guard must be able to fail: a page with one good and two broken links.
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Tensor parallel and `torch.compile`\n\n## Tensor parallel and `torch.compile`\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#tensor-parallel-and-torchcompile-1) [gone](docs/b.md) [bad](docs/a.md#nope)\n"
        "`[in code](docs/c.md)`\n```\n[fenced](docs/d.md)\n```\n[web](https://example.com/x#y) [self](#title)\n"
    )
    broken, checked = broken_links([page], root=tmp_path)
    assert checked == 4
    assert [b.split(" ", 1)[1] for b in broken] == [
        "docs/b.md (no such file)",
        "docs/a.md#nope (no heading with id 'nope' in a.md)",
        "#title (no heading with id 'title' in README.md)",
    ]


def test_slugs_follow_github():
    assert slug("Tensor parallel and torch.compile") == "tensor-parallel-and-torchcompile"
    assert slug("Runs I, J and K") == "runs-i-j-and-k"
    assert slug("Where a step goes: the default, before and after (`breakdown.py`)") == (
        "where-a-step-goes-the-default-before-and-after-breakdownpy"
    )
    assert slug("Start-up: a mesh of the dimensions in use") == "start-up-a-mesh-of-the-dimensions-in-use"
