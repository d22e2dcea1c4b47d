"""Fixtures of the cluster-in-a-box tests: clusters made and always removed, the corpus on the
cluster's shared directory, hang guards scaled by this host's measured speed, and reading a run.

Where a cluster cannot be made (not root, no iproute2, no cgroup v1), a test skips with the reason,
except under CI=true, where it fails: CI runs as root on a machine that has all of it, so a skip
there would hide a broken harness."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import harness  # noqa: E402


def _cannot_run(why: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"cluster test cannot run under CI: {why}")
    pytest.skip(why)


@pytest.fixture
def make_cluster(corpus_dir):
    """make_cluster(n, hostnames=...) -> a started harness.Cluster with the test corpus at
    `cluster.shared / "data"`; every cluster made is removed after the test, pass or fail, and
    the test fails if anything of it is left on the host."""
    why = harness.missing_requirements()
    if why:
        _cannot_run(why)
    made = []

    def make(n: int, hostnames: str = "own-address") -> harness.Cluster:
        c = harness.Cluster(n, hostnames)
        made.append(c)
        c.start()
        shutil.copytree(corpus_dir, c.shared / "data")
        return c

    yield make
    left = []
    for c in made:
        c.close()
        left += c.leftovers()
    assert not left, f"the cluster harness left these behind: {left}"


@pytest.fixture
def guard(hang_deadline):
    """guard(seconds on the reference host) -> a hang guard for this host: generous (x4) and scaled
    by the root conftest's measured slowdown (hang_deadline). It only stops a hung test; no result
    depends on it."""
    return lambda reference_s: 4.0 * hang_deadline(reference_s)

