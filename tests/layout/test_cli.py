"""`ndtrain config check --world N`, `config show` and `verify --layouts`: exit codes, one-line
errors naming the key, the one layout syntax."""

from __future__ import annotations

import pytest

from ndtrain.cli import main as cli

PLAN_70B = ["--model.preset=llama3-70b", "--data.seq_len=8192", "--train.global_batch=512"]


def _one_line_error(capsys, word: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and word in err, err
    return err


def test_config_check_prints_the_layout_it_would_build(capsys, tmp_path):
    before = set(tmp_path.iterdir())
    assert cli(["config", "check", "--world", "256", *PLAN_70B, "--parallel.tp=2", "--parallel.cp=4",
                "--parallel.pp=4", "--parallel.zero=1", "--parallel.pp_schedule=InterleavedZeroBubble",
                "--parallel.pp_virtual_stages=8", "--train.micro_batch=1"]) == 0
    out = capsys.readouterr().out
    for word in ("dp_shard=8", "ZeRO-1 over dp_shard x cp = 32 ranks", "InterleavedZeroBubble", "pp rank 3:",
                 "parameters (meta build)", "MFU counts", "ok: the runtime builds this layout"):
        assert word in out, word
    assert set(tmp_path.iterdir()) == before  # a check writes nothing


@pytest.mark.parametrize("mp,path", [("fp32", "torch's DDP reducer"), ("bf16", "on FSDP2")])
def test_config_check_says_which_runtime_path_replication_takes(capsys, mp, path):
    assert cli(["config", "check", "--world", "2", "--model.preset=debug", "--parallel.dp_replicate=2",
                "--parallel.dp_shard=1", f"--parallel.mixed_precision={mp}"]) == 0
    assert f"replicated (DDP, {path}" in capsys.readouterr().out


@pytest.mark.parametrize("args,key", [
    (["--world", "6", "--parallel.tp=4"], "parallel.dp_shard"),  # 6 ranks do not split into tp=4
    (["--world", "8", "--parallel.tp=8", "--model.preset=debug", "--model.n_kv_heads=2"], "parallel.tp"),
    (["--world", "4", "--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero=2",
      "--parallel.reshard_after_forward=false"], "parallel.zero"),
    (["--world", "2", "--parallel.ep=-1"], "parallel.ep"),  # dense model: ep honoured (2), then refused
    (["--world", "8", "--parallel.pp_schedule=Zigzag"], "pp_schedule"),
    # DiLoCo's rule (layout/diloco.py) with the world: dp_replicate = -1 takes 1 of 2 ranks here.
    (["--world", "2", "--parallel.replicate_sync=diloco", "--parallel.dp_replicate=-1", "--parallel.dp_shard=2"],
     "parallel.replicate_sync"),
    (["--world", "4", "--parallel.replicate_sync=diloco", "--parallel.dp_replicate=2", "--parallel.dp_shard=2",
      "--parallel.diloco_fragments=3"], "parallel.diloco_fragments"),
    (["--world", "0"], "--world"),
    ([], "--world"),
])
def test_config_check_refuses_with_one_line(capsys, args, key):
    assert cli(["config", "check", *args]) == 2
    _one_line_error(capsys, key)


def test_config_show_fails_on_what_no_world_can_fix(capsys):
    assert cli(["config", "show", "--parallel.tp=3"]) == 2  # the debug model has 8 heads
    _one_line_error(capsys, "parallel.tp")
    assert cli(["config", "show", "--parallel.zero=2"]) == 2  # changed meaning: say which
    _one_line_error(capsys, "reshard_after_forward")
    assert cli(["config", "show", "--parallel.zero=2", "--parallel.reshard_after_forward=false"]) == 0
    assert "zero = 2" in capsys.readouterr().out
    assert cli(["config", "show", "--parallel.zero=1"]) == 0
    assert "reshard_after_forward = false" in capsys.readouterr().out  # ZeRO-1 keeps parameters gathered


def test_a_stored_config_keeps_the_old_meaning_of_zero_2():
    from ndtrain.config import from_dict, load_config, to_dict

    old = to_dict(load_config(None, {}))
    old["parallel"]["zero"] = 2
    del old["parallel"]["reshard_after_forward"]  # as a checkpoint written before the change stores it
    cfg = from_dict(old)
    assert (cfg.parallel.zero, cfg.parallel.reshard_after_forward) == (3, False)


def test_verify_needs_a_layout_and_the_one_syntax(capsys):
    assert cli(["verify"]) == 2
    _one_line_error(capsys, "layout")
    assert cli(["verify", "--layouts", "dp_shard=4 tp=2"]) == 2  # the old syntax, quoted: one argument
    _one_line_error(capsys, "joined by commas")
    assert cli(["verify", "--layouts", "dp_shard=2,tp=3"]) == 2  # checked before any rank starts
    _one_line_error(capsys, "parallel.")


@pytest.mark.timeout(300)
def test_verify_one_layout_per_argument(capsys, corpus_dir):
    assert cli(["verify", "--layouts", "dp_shard=2", "tp=2,sequence_parallel=0", "--steps", "2", f"--data.path={corpus_dir}",
                "--data.seq_len=64", "--train.global_batch=8", "--optimizer.eps=1e-6", "--optimizer.lr=1e-3",
                "--optimizer.warmup_steps=0"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard=2 " in out and "tp=2,sequence_parallel=0" in out and out.count("PASS") == 2


def test_ep_alone_takes_that_many_data_parallel_ranks(capsys):
    from ndtrain.tools.verify import layout_overrides, layout_world

    # `--nproc 2 --parallel.ep=2` on an MoE config: dp_shard = -1 takes both ranks, ep borrows them
    assert cli(["config", "check", "--world", "2", "--model.preset=debug-moe", "--parallel.ep=2"]) == 0
    assert "expert parallel: ep=2" in capsys.readouterr().out
    # and in verify's syntax, `ep=2` alone is a world of 2 (dp_shard = ep / cp)
    assert layout_world(layout_overrides("ep=2")) == 2 and layout_world(layout_overrides("ep=4,cp=2")) == 4


def test_diloco_is_checked_like_any_layout(capsys):
    """replicate_sync is a layout key: config show, config check and verify run its rule."""
    assert cli(["config", "show", "--parallel.replicate_sync=diloco"]) == 2  # dp_replicate = 1: no world fixes it
    _one_line_error(capsys, "parallel.replicate_sync")
    assert cli(["config", "check", "--world", "4", "--parallel.replicate_sync=diloco", "--parallel.dp_replicate=2",
                "--parallel.dp_shard=2", "--parallel.zero=1"]) == 0
    out = capsys.readouterr().out
    assert "diloco H=8" in out and "ok: the runtime builds this layout" in out, out
    assert cli(["verify", "--layouts", "dp_shard=2,replicate_sync=diloco"]) == 2  # refused before any rank starts
    _one_line_error(capsys, "parallel.replicate_sync")
