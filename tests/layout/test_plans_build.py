"""`plan --strict` for the five plans in docs/results/planner-validation.md: the layout each plan
picks passes `config check --world N`, run exactly as the plan prints it."""

from __future__ import annotations

import shlex

import pytest

from ndtrain.cli import main as cli

PLANS = [  # as in docs/results/planner-validation.md ("Plans")
    ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "8192", "--global-batch-tokens", "1M"],
    ["--model", "llama3-70b", "--gpus", "256", "--gpu", "h100", "--seq", "8192", "--global-batch-tokens", "4M"],
    ["--model", "llama3-405b", "--gpus", "16384", "--gpu", "h100", "--seq", "8192", "--global-batch-tokens", "16M",
     "--network", "pod=3072,oversub=7"],
    ["--model", "mixtral-8x7b", "--gpus", "64", "--gpu", "h800", "--seq", "4096", "--global-batch", "256"],
    ["--model", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--seq", "4096", "--global-batch", "15360",
     "--precision", "fp8"],
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", PLANS, ids=[p[1] for p in PLANS])
def test_the_plans_layout_passes_config_check(capsys, plan):
    assert cli(["plan", *plan, "--strict", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    command = out[out.index("check #1 with the runtime's own rules, no GPU needed:") + 1].strip()
    args = shlex.split(command)
    assert args[:3] == ["ndtrain", "config", "check"]
    assert cli(args[1:]) == 0, capsys.readouterr().err
    assert "ok: the runtime builds this layout" in capsys.readouterr().out
