"""`ndtrain config check --world N`: everything the runtime would check for N ranks, with no
process group, before anyone rents N GPUs.

It runs ndtrain.layout.problems() for the world (the same call `train` makes before its first
collective), plans the layout first if `[parallel] auto` is on, then builds every pipeline
rank's stages on the meta device (no memory), as the runtime would, and prints the layout it
would build (with the defaults' data-parallel choice, `dp_auto`, made as `train` makes it). Exit 0, or 2 with one line naming the config key to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import lru_cache

from ndtrain.config import JobConfig, layout_batches, load_config, to_toml
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.layout import Layout, fill_degrees, from_config, problems
from ndtrain.layout import schedules as registry
from ndtrain.layout.flops import MFU_CONVENTION, flops_per_token
from ndtrain.layout.partition import pipeline_split, stage_layers
from ndtrain.model.config import ModelConfig


def check_config(cfg: JobConfig, world: int, build: bool = True) -> tuple[Layout, list[str]]:
    """(the layout `cfg` builds on `world` ranks, a description of it), or ConfigError naming
    the first problem (and counting the others)."""
    if world < 1:
        raise NdtrainError(f"--world must be >= 1, got {world}")
    from ndtrain.train.plan import planned_config

    cfg = planned_config(cfg, world)  # as `ndtrain train` would resolve it (the caller's cfg stays as it was)
    lay = from_config(cfg.parallel, cfg.train, cfg.data)
    found = problems(lay, cfg.model, world, cfg.data.seq_len, layout_batches(cfg.train))
    if found:
        more = f" (and {len(found) - 1} more: {', '.join(sorted({p.key for p in found[1:]}))})" if len(found) > 1 else ""
        raise ConfigError(found[0].key, f"{found[0]}{more}")
    lay = fill_degrees(lay, world)
    if cfg.parallel.batch_shares:  # uneven shares need the data-parallel degree
        from ndtrain.layout.batch_shares import check_shares

        check_shares(list(cfg.parallel.batch_shares), lay.dp, layout_batches(cfg.train), lay.micro_batch)
    ranks = stage_plan(cfg, lay)
    if build:
        for r in ranks:
            r["params"] = sum(_stage_params(cfg.model, tuple(s["layers"]), s["first"], s["last"]) for s in r["stages"])
    return lay, report_lines(cfg, lay, world, ranks)


def stage_plan(cfg: JobConfig, lay: Layout) -> list[dict]:
    """Per pipeline rank: its stages (index, layers, whether it holds the embedding / the head)."""
    n = lay.stages
    counts = pipeline_split(cfg.model, cfg.data.seq_len, lay) if lay.pp > 1 \
        else [cfg.model.n_layers]
    layers = stage_layers(counts)
    sched = registry.get(lay.pp_schedule)
    out = []
    for rank in range(lay.pp):
        stages = sched.rank_stages(lay.pp, lay.pp_virtual_stages, rank) if lay.pp > 1 else [0]
        out.append({"rank": rank, "stages": [{"index": s, "layers": layers[s], "first": s == 0, "last": s == n - 1}
                                             for s in stages]})
    return out


def _stage_params(model: ModelConfig, layers: tuple, first: bool, last: bool) -> int:
    """Parameters of one stage, counted on its meta-device build (what the runtime constructs).
    Stages of the same make-up (dense/MoE layers, ends) are built once."""
    kinds = tuple(model.is_moe_layer(i) for i in layers)
    return _build_count(dataclasses.astuple(model), layers[0] if layers else 0, kinds, first, last)


@lru_cache(maxsize=512)
def _build_count(model_key: tuple, start: int, kinds: tuple, first: bool, last: bool) -> int:
    from ndtrain.parallel.pipeline import build_stage_module

    model = ModelConfig(*model_key)
    part = build_stage_module(model, list(range(start, start + len(kinds))), first, last)
    assert all(p.is_meta for p in part.parameters())
    return sum(p.numel() for p in part.parameters())


def _human(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.3g}"


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def report_lines(cfg: JobConfig, lay: Layout, world: int, ranks: list[dict]) -> list[str]:
    seq, batches = cfg.data.seq_len, layout_batches(cfg.train)
    gb = cfg.train.global_batch
    z = lay.effective_zero
    diloco = lay.replicate_sync == "diloco"
    keys = ["pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "zero", "reshard_after_forward", "pp_schedule",
            "pp_virtual_stages", "micro_batch", "activation_checkpoint"]
    keys += ["replicate_sync", "diloco_inner_steps", "diloco_fragments", "diloco_overlap_steps"] if diloco else []
    lines = [f"layout: {lay.describe()} on {world} ranks; mesh [pp, dp_replicate, dp_shard, cp, tp] = "
             f"{list(lay.shape)}", f"as text: {lay.text(keys)}"]
    if z:
        what = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters, gradients and optimizer state"}[z]
        detail = ("; parameters freed after each forward" if lay.reshards_after_forward
                  else "; gathered parameters kept from forward to backward") if z == 3 else ""
        reduce = "after every micro-batch" if lay.grads_sharded_per_microbatch else "once per step"
        lines.append(f"data parallel: dp={lay.dp}; ZeRO-{z} over dp_shard x cp = {lay.shard_degree} ranks ({what} "
                     f"sharded{detail}), gradients reduced {reduce}"
                     + (f"; replicated x{lay.dp_replicate} (HSDP)" if lay.dp_replicate > 1 and not diloco else ""))
    else:
        ddp = "replicated (DDP" + (", torch's DDP reducer: bucketed all-reduces during the backward)"
                                   if lay.on_ddp_reducer(cfg.model.is_moe) else ", on FSDP2)")
        lines.append(f"data parallel: dp={lay.dp}, " + (ddp if lay.dp > 1 and not diloco else
                                                        "none" if lay.dp == 1 else "replicas"))
    if diloco:
        frag = f", in {lay.diloco_fragments} staggered fragments" if lay.diloco_fragments > 1 else ""
        over = f", each applied {lay.diloco_overlap_steps} steps late" if lay.diloco_overlap_steps else ""
        lines.append(f"replicas: {lay.dp_replicate} synced by DiLoCo (diloco H={lay.diloco_inner_steps}): an outer "
                     f"step every {lay.diloco_inner_steps} steps{frag}{over}, {lay.diloco_outer_dtype} outer gradient; "
                     f"inner steps stay inside a replica")
    if lay.tp > 1:
        lines.append(f"tensor parallel: tp={lay.tp}" + (", sequence parallel" if lay.sequence_parallel else ""))
    if lay.cp > 1:
        lines.append(f"context parallel: cp={lay.cp}, {lay.cp_attention} attention, {seq // lay.cp} tokens per rank")
    if lay.ep > 1:
        lines.append(f"expert parallel: ep={lay.ep} ({cfg.model.n_experts // lay.ep} experts per rank), expert states "
                     f"sharded over {lay.expert_shard_degree} ranks")
    rows = gb // lay.dp
    m = lay.micro_batches(gb)
    lines.append(f"batch: {gb} sequences x {seq} tokens per step ({', '.join(map(str, batches))} over the ramp); "
                 f"{rows} per data-parallel rank in {m} micro-batches of {-(-rows // m)}")
    if lay.pp > 1:
        lines.append(f"pipeline: {lay.pp_schedule}, pp={lay.pp}, pp_virtual_stages={lay.pp_virtual_stages}, "
                     f"{lay.stages} stages, split {lay.pp_split}" + (" (explicit)" if lay.layers_per_stage else ""))
    for r in ranks:
        parts = []
        for s in r["stages"]:
            ends = (" + embedding" if s["first"] else "") + (" + norm, head" if s["last"] else "")
            parts.append(f"stage {s['index']}: layers {_span(s['layers'])}{ends}")
        params = f"; {_human(r['params'])} parameters (meta build), ~{_human(r['params'] / lay.tp)} per tp rank" \
            if "params" in r else ""
        lines.append(f"  pp rank {r['rank']}: " + "; ".join(parts) + params)
    lines.append(f"activation checkpointing: {lay.activation_checkpoint}; precision: {lay.mixed_precision}; "
                 f"{MFU_CONVENTION}: {flops_per_token(cfg.model, seq) / 1e9:.3g} GFLOP/token")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain config check", add_help=True,
                                description="Check a config for a world size without starting any process.")
    p.add_argument("--world", type=int, required=False, help="number of ranks (GPUs) the run will use")
    p.add_argument("--config", help="TOML file (default: built-in defaults)")
    args, rest = p.parse_known_args(argv)
    if args.world is None:
        raise NdtrainError("config check needs --world N (the number of ranks the run will use)")
    cfg = load_config(args.config, rest)
    _, lines = check_config(cfg, args.world)
    sys.stdout.write("\n".join(lines) + "\nok: the runtime builds this layout\n")
    return 0


def config_main(argv: list[str]) -> int:
    """`ndtrain config`: `check` (main above), `show` and help (show_main)."""
    if argv and argv[0] == "check":
        return main(argv[1:])
    return show_main(argv)


def show_main(argv: list[str]) -> int:
    """`ndtrain config show [--config F] [overrides]`: the resolved config (checked for what any
    world would have wrong); `ndtrain config check --world N ...`: everything for N ranks."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "show" and {"-h", "--help"} & set(argv[1:])):
        print("usage: ndtrain config show [--config F] [--section.key=value ...]\n"
              "       ndtrain config check --world N [--config F] [--section.key=value ...]")
        return 0
    action, rest = argv[0], argv[1:]
    if action != "show":  # `check` was answered by config_main
        raise NdtrainError(f"unknown config action {action!r}; use `config show` or `config check --world N`")
    path = None
    if "--config" in rest:
        i = rest.index("--config")
        if i + 1 >= len(rest):
            raise NdtrainError("--config needs a file")
        path, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    else:
        for i, a in enumerate(rest):
            if a.startswith("--config="):
                path, rest = a.split("=", 1)[1], rest[:i] + rest[i + 1:]
                break
    cfg = load_config(path, rest)
    sys.stdout.write(to_toml(cfg))
    return 0

