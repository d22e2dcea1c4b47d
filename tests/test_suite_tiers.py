"""The suite's tiers: `make test` (pyproject's default selection), the heavy tier CI runs after it,
and the slow tier. A heavy test left out of CI, or a default selection the budget report does not
recognise, would silently drop coverage or budget checks."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_selection_is_what_the_budget_report_judges(pytestconfig):
    # The root conftest as pytest loaded it: `import conftest` may find tests/data's under xdist.
    root_conftest = next(p for p in pytestconfig.pluginmanager.get_plugins()
                         if getattr(p, "__file__", None) == str(ROOT / "tests" / "conftest.py"))
    DEFAULT_SELECTION = root_conftest.DEFAULT_SELECTION
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert addopts == f"-m '{DEFAULT_SELECTION}'"


def test_ci_runs_the_default_and_the_heavy_tier():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip().startswith("make ")]
    assert commands[-2:] == ["make test", "make test-heavy"]
    make = (ROOT / "Makefile").read_text()
    heavy = re.search(r"^test-heavy:.*\n\t(.*)$", make, re.M)
    assert heavy and "-m heavy" in heavy.group(1)
