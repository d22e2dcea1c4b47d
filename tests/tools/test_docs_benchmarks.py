"""docs/results/ says where every figure ran, and today's figures per host kind come first.

A ratio measured on one CPU says little about another (an AMX host multiplies bf16 ~10x faster
than fp32, the AMD EPYC these docs were measured on ~2.2x), so a table without its host is a
figure a reader on another machine will misread. These tests read the doc, nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
DOC = RESULTS / "benchmarks.md"  # today's figures
# The pages of measured runs and how near its table a table's `Host:` line must be: after the
# previous table on today's page (its tables ran on different hosts), anywhere in the table's own
# section in the history and in the dry run's figures (each section ran on one host; the dry run's
# memory and bytes are no host's, its CPU seconds are). planner-validation.md holds predictions
# against published runs, which ran on no host of ours.
MEASURED = {"benchmarks.md": "table", "history.md": "section", "dryrun.md": "section"}
FIRST_SCREEN = 60  # lines a reader sees before scrolling: today's figures must be there

# The line benchmarks/common.py's host_header() prints, as the doc writes it before each table:
# "Host: CPU model [kernel flags], ...; torch X.Y.Z...; a date (or 'date not recorded')".
HOST = re.compile(
    r"^host: (?P<cpu>[^\[;]*[A-Za-z][^\[;]*?) \[(?P<flags>[^\]]+)\]"
    r".*\btorch (?P<torch>\d+\.\d+\.\d+\S*)"
    r".*(?P<date>\d{4}-\d{2}-\d{2}|date not recorded)",
    re.IGNORECASE,
)


def _lines(doc: Path = DOC) -> list[str]:
    """The doc's lines with fenced code blocks blanked (a '|' inside a code block is no table)."""
    out, fenced = [], False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def _table_starts(lines: list[str]) -> list[int]:
    """Index of each table's header row: a '|' row followed by a |---| separator."""
    return [
        i for i in range(len(lines) - 1)
        if lines[i].startswith("|") and re.match(r"^\|\s*:?-", lines[i + 1]) and not (i and lines[i - 1].startswith("|"))
    ]


def test_the_first_screen_has_a_table_per_host_kind_with_cpu_torch_and_date():
    lines = _lines()
    hosts = [i for i, line in enumerate(lines[:FIRST_SCREEN]) if line.lower().startswith("host:")]
    assert hosts, f"no 'Host:' line in the first {FIRST_SCREEN} lines of {DOC.name}"
    starts = _table_starts(lines)
    for i in hosts:
        match = HOST.match(lines[i])
        assert match, f"line {i + 1} does not name a CPU model [flags], a torch version and a date: {lines[i]!r}"
        # The host's table follows its host line, before the next heading, inside the first screen.
        table = next((s for s in starts if s > i), None)
        heading = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("#")), len(lines))
        assert table is not None and table < heading, f"host line {i + 1} has no table under it"
        assert table < FIRST_SCREEN, f"the table of host line {i + 1} starts at line {table + 1}"


@pytest.mark.parametrize("page, scope", MEASURED.items())
def test_every_table_names_where_it_ran(page, scope):
    lines = _lines(RESULTS / page)
    starts = _table_starts(lines)
    assert len(starts) > 5, "the doc's tables were not found"
    missing = []
    for n, start in enumerate(starts):
        # The table's own stretch of text: after the previous table (or heading), up to its header row.
        previous_table = [starts[n - 1] if n and scope == "table" else 0]
        floor = max(previous_table + [j for j in range(start) if lines[j].startswith("#")])
        stretch = [line for line in lines[floor:start] if line.lower().startswith("host:")]
        if not any(HOST.match(line) for line in stretch):
            missing.append(f"line {start + 1}: {lines[start][:70]}")
    assert not missing, "tables with no 'Host: CPU [flags] ... torch ... date' line:\n" + "\n".join(missing)


def test_every_results_page_has_tables_under_host_lines_or_is_listed():
    # A new results page must be placed: under the host-line check, or named here as holding none.
    assert {p.name for p in RESULTS.glob("*.md")} == set(MEASURED) | {"planner-validation.md"}
