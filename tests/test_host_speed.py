"""The suite's hang guards scale with this host's measured speed (tests/conftest.py): a wait
inside a test (hang_deadline) and every pytest-timeout limit are set for the reference host of
tests/budgets.toml and multiplied by how much slower this host measures, never below 1."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace


def _conftest(config):
    return config.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))


def test_the_slowdown_is_never_below_1_and_grows_as_the_host_falls_behind(pytestconfig):
    probe = _conftest(pytestconfig)._host_slowdown
    assert probe({"op_us": 1e9, "matmul_gflops": 1e-9})[0] == 1.0  # a reference slower than any host
    slower = probe({"op_us": 1e-3, "matmul_gflops": 1e6})  # a reference faster than any host
    assert slower[0] > 1e3 and "GFLOP/s" in slower[1]


def test_hang_deadline_and_timeout_limits_scale_by_the_same_measured_factor(pytestconfig, hang_deadline,
                                                                              monkeypatch):
    from pytest_timeout import Settings

    conftest = _conftest(pytestconfig)
    scale, _ = conftest.host_slowdown(pytestconfig)
    assert scale >= 1.0 and hang_deadline(7.0) == 7.0 * min(scale, conftest.HANG_SCALE_CAP)
    plugin = pytestconfig.pluginmanager.get_plugin("timeout")
    set_to = []
    monkeypatch.setattr(plugin, "pytest_timeout_set_timer", lambda item, settings: set_to.append(settings) or True)
    assert pytestconfig.hook.pytest_timeout_set_timer(item=SimpleNamespace(config=pytestconfig),
                                                      settings=Settings(7.0, "signal", False, False)) is True
    assert [s.timeout for s in set_to] == [hang_deadline(7.0)] and set_to[0].method == "signal"


def test_a_hang_guard_stretches_at_most_to_the_cap(pytestconfig, monkeypatch):
    conftest = _conftest(pytestconfig)
    monkeypatch.setattr(conftest, "host_slowdown", lambda config: (21.6, "a loaded host"))
    assert conftest.hang_scale(pytestconfig) == conftest.HANG_SCALE_CAP == 6.0
