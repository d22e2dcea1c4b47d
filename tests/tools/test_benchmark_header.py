"""Benchmarks say where they ran: CPU model and kernel flags, the torch build, the date."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import KERNEL_FLAGS, host_header  # noqa: E402


def test_header_names_the_cpu_its_flags_and_the_torch_build():
    line = host_header()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), None)
    if model:
        assert model in line
        flags = set(next(ln for ln in cpuinfo.splitlines() if ln.startswith("flags")).split(":", 1)[1].split())
        for flag in KERNEL_FLAGS:  # exactly the host's own kernel flags, no more
            assert (f"{flag}," in line or f"{flag}]" in line) == (flag in flags), flag
    assert f"torch {torch.__version__}" in line and "UTC" in line and "load average" in line


def test_peers_prints_the_header():
    assert "print(host_header()" in (ROOT / "benchmarks" / "peers.py").read_text()
