"""An empty search names the rule or refusal that emptied it and the flag that lifts it, not a
generic "no layout fits in memory" (issue 30, item 2). In-process CLI calls, --samples 0."""

import json

from ndtrain.cli import main as cli

GELU_1B = "layers=24,hidden=2048,heads=16,mlp=gelu,vocab=51200"


def plan(capsys, *args):
    rc = cli(["plan", "--samples", "0", *args])
    captured = capsys.readouterr()
    return rc, captured.out


def test_strict_runtime_refusal_names_the_rule_and_relaxed(capsys):
    rc, out = plan(capsys, "--model-shape", GELU_1B, "--gpus", "8", "--seq", "2048", "--global-batch", "64")
    assert rc == 1
    assert "no layout fits in memory" not in out
    assert "model.mlp" in out and "swiglu" in out and "--relaxed" in out
    # and --relaxed does lift it
    rc, out = plan(capsys, "--model-shape", GELU_1B, "--gpus", "8", "--seq", "2048", "--global-batch", "64",
                   "--relaxed", "--top", "1")
    assert rc == 0 and "#1" in out


def test_zero1_over_replicas_names_dp_shard(capsys):
    # Llama 3 8B's states are 16 B/param = 128 GB whole: ZeRO-1 over dp_shard=1 shards nothing
    rc, out = plan(capsys, "--model", "llama3-8b", "--gpus", "48", "--seq", "4096", "--global-batch", "96",
                   "--fix", "dp_replicate=48,zero=1")
    assert rc == 1
    assert "no layout fits in memory" not in out
    assert "zero=1 shards model states over dp_shard" in out and "dp_shard=" in out
    assert "dp_replicate=48" in out


def test_refusal_in_json_and_memory_still_named_when_memory_empties_it(capsys):
    rc, out = plan(capsys, "--model-shape", GELU_1B, "--gpus", "8", "--seq", "2048", "--global-batch", "64",
                   "--json")
    assert rc == 1
    refusal = " ".join(json.loads(out)["refusal"])
    assert "model.mlp" in refusal and "--relaxed" in refusal
    # a model too big for the GPUs at all: memory is the cause, and says so
    rc, out = plan(capsys, "--model", "llama3-405b", "--gpus", "8", "--seq", "8192", "--global-batch", "8")
    assert rc == 1 and "model states alone need" in out


def test_single_layout_refused_by_strict_rule_says_relaxed(capsys):
    rc = cli(["plan", "--samples", "0", "--model-shape", GELU_1B, "--gpus", "8", "--seq", "2048",
              "--global-batch", "64", "--layout", "dp_shard=8,micro_batch=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--relaxed" in err
