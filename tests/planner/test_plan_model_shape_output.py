"""`ndtrain plan --model-shape`: the check command it prints builds the model at the planned
sequence length (not the planner's 1M-token RoPE range), and the token budget behind days and
energy is said when it is the default, and taken from --tokens."""

from __future__ import annotations

import json

from ndtrain.cli import main as cli

SHAPE = ["plan", "--model-shape", "layers=4,hidden=256,heads=4,kv_heads=4,ffn=1024,vocab=256", "--gpus", "1",
         "--gpu", "h100", "--seq", "256", "--global-batch", "16", "--samples", "0", "--top", "1"]


def test_the_check_command_uses_the_planned_seq_len_and_passes(capsys):
    assert cli(SHAPE) == 0
    out = capsys.readouterr().out
    [check] = [line.strip() for line in out.splitlines() if line.strip().startswith("ndtrain config check")]
    assert "--model.max_seq_len=256 " in check and "1048576" not in out
    assert "days and energy are for a budget of 1T tokens (the default): give yours with --tokens" in out
    assert cli(check.split()[1:]) == 0  # the runtime's own checks accept what the planner printed
    assert "ok: the runtime builds this layout" in capsys.readouterr().out


def test_a_given_token_budget_is_used_and_not_called_a_default(capsys):
    assert cli([*SHAPE, "--tokens", "2B"]) == 0
    out = capsys.readouterr().out
    assert "2B tokens:" in out and "(the default)" not in out
    assert cli([*SHAPE, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["token_budget"] == 1e12 and plan["token_budget_from"] == "default"
