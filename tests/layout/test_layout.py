"""ndtrain.layout: the syntax, -1 resolution, the schedule rules, the stage partition, FLOPs and
problems() (each rule where it is decided), without processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout, fill_degrees, parse_items, parse_layout, problems
from ndtrain.layout import rules, schedules
from ndtrain.layout.flops import flops_per_token, recompute_flops_per_token
from ndtrain.layout.partition import pipeline_split, rank_layer_counts
from ndtrain.model.config import preset, replace


def test_one_syntax_with_aliases_lists_and_one_line_errors():
    assert parse_items("tp=2,pp_schedule=interleaved-1f1b,pp_virtual_stages=2,layers_per_stage=[3,5,5,3]") == \
        {"tp": 2, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 2, "layers_per_stage": (3, 5, 5, 3)}
    # the short forms of the migration table (KEY_ALIASES) still read, as the one name
    assert parse_items("sp=false,mb=4,raf=0,v=2,schedule=1f1b,ac=full") == {
        "sequence_parallel": False, "micro_batch": 4, "reshard_after_forward": False, "pp_virtual_stages": 2,
        "pp_schedule": "1F1B", "activation_checkpoint": "full"}
    for bad, word in (("tp=2,foo=1", "unknown key"), ("tp=two", "not an integer"), ("sequence_parallel=maybe", "not a boolean"),
                      ("tp", "bad item"), ("pp_schedule=Zigzag", "unknown pipeline schedule")):
        with pytest.raises(NdtrainError, match=word) as err:
            parse_items(bad)
        assert "\n" not in str(err.value)
    lay = parse_layout("tp=2,pp=4,pp_schedule=ZBVZeroBubble,zero=1", 64)
    assert (lay.dp_shard, lay.pp_virtual_stages, lay.reshard_after_forward) == (8, 2, False)  # the rest, the V's v, ZeRO-1
    assert parse_layout(lay.text(), 64) == lay  # round trip


@pytest.mark.parametrize("degree", ["pp", "dp_replicate", "dp_shard", "cp", "tp"])
def test_minus_one_is_honoured_for_every_mesh_degree(degree):
    other = "tp" if degree != "tp" else "pp"
    lay = fill_degrees(Layout(**{"dp_shard": 1, degree: -1, other: 2}), 8)
    assert getattr(lay, degree) == 4 and lay.world == 8


def test_minus_one_for_ep_and_the_refusals():
    assert fill_degrees(Layout(dp_shard=4, cp=2, ep=-1), 8).ep == 8
    cfg = preset("debug-moe")
    assert problems(Layout(dp_shard=-1, ep=-1), cfg, 4, 64, 8) == []
    assert problems(Layout(dp_shard=-1, ep=-1), cfg, 3, 64, 6)[0].key == "parallel.ep"  # 8 experts, 3 ranks
    with pytest.raises(NdtrainError, match="at most one"):
        fill_degrees(Layout(dp_shard=-1, tp=-1), 8)
    assert problems(Layout(dp_shard=-1, tp=3), preset("debug"), 8)[0].key == "parallel.dp_shard"  # 8 % 3


def test_schedule_registry_is_torchs_rule():
    # torch 2.13 runs interleaved schedules in rounds of max(1, m // p): p=4, m=6 is one round of 6.
    inter = schedules.get("Interleaved1F1B")
    assert inter.microbatch_problem(4, 2, 6) is None and inter.microbatch_problem(4, 2, 9)
    cfg = replace(preset("debug"), n_layers=8)
    lay = Layout(pp=4, pp_virtual_stages=2, pp_schedule="Interleaved1F1B", micro_batch=1)
    assert problems(lay, cfg, 4, 64, 6) == []  # the planner asks the same question
    assert schedules.get("DualPipeV").microbatch_problem(4, 2, 7)  # needs 2p
    assert schedules.get("1F1B").microbatch_problem(4, 1, 3)  # needs p
    assert set(schedules.SPLIT_BACKWARD) == {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}


def test_partition_balances_ranks_under_interleaving():
    cfg = preset("llama3-405b")
    for v in (1, 2, 7):
        lay = Layout(pp=16, pp_virtual_stages=v, pp_schedule="1F1B" if v == 1 else "Interleaved1F1B")
        counts = pipeline_split(cfg, 8192, lay)
        per_rank = rank_layer_counts(counts, schedules.get(lay.pp_schedule).stage_ranks(16, v), 16)
        # the embedding's and the head's ranks get a layer fewer, as Llama 3 405B was trained
        assert per_rank == [7] + [8] * 14 + [7] and sum(counts) == 126, v


def test_flops_conventions():
    cfg = preset("llama3-8b")
    attn = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 8192
    assert flops_per_token(cfg, 8192, "full") - flops_per_token(cfg, 8192, "causal") == pytest.approx(attn / 2)
    assert recompute_flops_per_token(cfg, 8192, "selective") == 0  # flash kernels: nothing extra
    assert recompute_flops_per_token(cfg, 8192, "full") > recompute_flops_per_token(cfg, 8192, "every_n") > 0


def test_megatron_formula_is_our_count_with_full_recompute():
    from ndtrain.planner.published import megatron_flops
    from ndtrain.planner.shapes import gpt_shape

    cfg = gpt_shape(12288, 96, 96)
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    paper = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))  # Narayanan et al. eq. (3)
    assert megatron_flops(cfg, b, s) == pytest.approx(paper, rel=1e-12)


def test_world_free_problems_are_those_every_world_has():
    cfg = preset("debug")
    assert problems(Layout(dp_shard=-1, tp=3), cfg, None)[0].key == "parallel.tp"  # no world makes 8 heads split 3 ways
    assert problems(Layout(dp_shard=-1, pp=2), cfg, None, 64, 8) == []  # fine on some world
    # a global batch of 6 over dp_shard=-1: some worlds fail (4), others do not (2)
    assert problems(Layout(dp_shard=-1), cfg, None, 64, 6) == []
    assert problems(Layout(dp_shard=4), cfg, None, 64, 6)[0].key == "train.global_batch"


def test_strict_is_this_runtime_relaxed_admits_published_layouts():
    gpt = replace(preset("debug"), mlp="gelu", n_kv_heads=2)
    lay = Layout(dp_shard=1, tp=4)
    strict = {p.key for p in problems(lay, gpt, 4)}
    assert strict == {"model.mlp", "parallel.tp"}  # GeLU, and kv heads replicated over tp
    assert problems(lay, gpt, 4, strict=False) == []


def test_rules_are_one_list_a_rule_set_joins_with_one_append():
    calls = []

    def fp8_like(ctx):
        calls.append(ctx.lay.world)
        yield "parallel.fp8", "example"

    rules.RULES.append(fp8_like)
    try:
        found = problems(Layout(dp_shard=2), preset("debug"), 2)
    finally:
        rules.RULES.remove(fp8_like)
    assert calls == [2] and found[-1].key == "parallel.fp8"


def test_layout_package_imports_no_torch():
    code = ("import sys, ndtrain.layout, ndtrain.layout.flops, ndtrain.layout.timeline; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_name_per_key_and_the_short_forms_only_in_the_migration_table():
    """Each Layout field is spelt as its config key; the short forms older commands used are read
    through KEY_ALIASES alone (into a real field), and the Layout answers to none of them."""
    import dataclasses

    from ndtrain.config import JobConfig
    from ndtrain.layout.degrees import FIELDS
    from ndtrain.layout.syntax import KEY_ALIASES
    from ndtrain.model.config import preset
    from ndtrain.planner.api import predict

    config = {f.name for f in dataclasses.fields(JobConfig().parallel)} | {"micro_batch", "document_mask"}
    assert {f.name for f in FIELDS} <= config
    names = {f.name for f in FIELDS}
    assert set(KEY_ALIASES.values()) <= names and not set(KEY_ALIASES) & names
    for short in KEY_ALIASES:
        assert not hasattr(Layout(), short), short
    # a layout dict written with the short forms (an older script's) prices as the one-name dict
    old = {"dp_shard": 1, "pp": 2, "schedule": "1F1B", "mb": 2, "ac": "full"}
    new = {"dp_shard": 1, "pp": 2, "pp_schedule": "1F1B", "micro_batch": 2, "activation_checkpoint": "full"}
    a, b = (predict(preset("debug"), d, 64, 8, "h100", world=2) for d in (old, new))
    assert a.layout == b.layout and a.step_time == b.step_time and a.layout.micro_batch == 2
