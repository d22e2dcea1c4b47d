"""`problems()`: the only validity check of a layout. The config validator, `config check`, the
mesh and pipeline builders, `verify`, `[parallel] auto` and the planner's search all call it.

Each rule is a function of one `Context` yielding (config key, message) pairs; `RULES` is the
list `problems()` runs, in order. Adding a rule set (e.g. FP8's) is one `RULES.append(fn)`.

`strict` (the default) is what the ndtrain runtime builds. `strict=False` drops the rules that
are facts about this runtime rather than about the layout, so the planner can also cost the
layouts of published Megatron-LM runs (kv-head replication when tp exceeds the kv heads,
GeLU MLPs, padded vocabularies); those layouts are never trained here.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Callable, Iterable

from ndtrain.layout import schedules as sch
from ndtrain.layout.degrees import DEGREES, FIELDS, MESH_ORDER, DegreeError, Layout, fill_degrees
from ndtrain.layout.partition import partition_problem
from ndtrain.model.config import ModelConfig


class LayoutProblem(str):
    """A problem message that also carries the config key it is about (`.key`)."""

    key: str

    def __new__(cls, key: str, message: str):
        obj = super().__new__(cls, message)
        obj.key = key
        return obj


@dataclass(frozen=True)
class Context:
    lay: Layout  # resolved: no -1 degrees left
    model: ModelConfig
    world: int
    seq: int | None  # tokens per sequence (None: unknown, sequence rules skipped)
    batches: tuple[int, ...]  # every global batch (sequences) the run uses; () = unknown
    strict: bool


Rule = Callable[[Context], Iterable[tuple[str, str]]]


# Read once, for problems() is hot (the planner's search asks it per candidate): the named fields,
# a getter of their values and every combination of values within the vocabularies.
_NAMED = [(f.name, f"{f.section}.{f.name}", f.choices) for f in FIELDS if f.choices]
_named_values = operator.attrgetter(*(name for name, _, _ in _NAMED))
_WITHIN_VOCABULARIES = frozenset(itertools.product(*(allowed for _, _, allowed in _NAMED)))


def values(c: Context):
    lay = c.lay
    if lay.zero not in (1, 2, 3):
        yield "parallel.zero", f"must be 1, 2 or 3 (the ZeRO stage), got {lay.zero}"
    elif lay.zero in (1, 2) and lay.reshard_after_forward:
        yield ("parallel.reshard_after_forward", f"zero={lay.zero} keeps parameters gathered (only optimizer state"
               f"{'' if lay.zero == 1 else ' and gradients'} are sharded); reshard_after_forward applies to "
               f"zero=3: set it false, or zero=3")
    # Each named value against its field's vocabulary (the Literal types of layout/degrees.py, which
    # the config's validator reads too): a Layout built in Python or from text meets them here.
    if _named_values(lay) not in _WITHIN_VOCABULARIES:
        for name, key, allowed in _NAMED:
            value = getattr(lay, name)
            if value not in allowed:
                yield key, f"must be one of {', '.join(allowed)}, got {value!r}"
    if lay.ac_every < 1:
        yield "parallel.ac_every", f"must be positive, got {lay.ac_every}"
    if lay.micro_batch < 1:
        yield "train.micro_batch", f"must be positive, got {lay.micro_batch}"
    if lay.pp_virtual_stages < 1:
        yield "parallel.pp_virtual_stages", f"must be positive, got {lay.pp_virtual_stages}"
    if lay.pp_microbatches < 0:
        yield "parallel.pp_microbatches", f"must be >= 0, got {lay.pp_microbatches}"
    # Checked whatever pp is: a misspelt schedule must not wait for the day pp > 1.
    if lay.pp_schedule not in sch.SCHEDULES:
        yield "parallel.pp_schedule", f"unknown schedule {lay.pp_schedule!r} (choose from {', '.join(sch.NAMES)})"


def model_runs_here(c: Context):
    if c.strict and c.model.mlp != "swiglu":
        yield "model.mlp", "the runtime model implements mlp='swiglu' only ('gelu' describes published GPT shapes)"


def tensor_parallel(c: Context):
    tp, m = c.lay.tp, c.model
    if tp == 1:
        return
    if m.n_heads % tp:
        yield "parallel.tp", f"model.n_heads={m.n_heads} is not divisible by tp={tp}"
    if m.n_kv_heads % tp and (c.strict or tp % m.n_kv_heads):
        # Megatron replicates kv heads when tp is a multiple of them; ndtrain shards them.
        yield "parallel.tp", (f"model.n_kv_heads={m.n_kv_heads} is not divisible by tp={tp} (kv-heads are "
                              f"sharded, not replicated)")
    if c.strict:
        if m.ffn_dim % tp:
            yield "parallel.tp", f"model.ffn_dim={m.ffn_dim} is not divisible by tp={tp}"
        if m.vocab_size % tp:
            yield "parallel.tp", f"model.vocab_size={m.vocab_size} is not divisible by tp={tp} (vocab-parallel head)"


def context_parallel(c: Context):
    cp = c.lay.cp
    if cp == 1:
        return
    if c.seq and c.seq % (2 * cp):
        yield "data.seq_len", f"seq_len={c.seq} must be divisible by 2*cp={2 * cp} for load-balanced causal chunks"
    if c.model.is_moe and c.model.capacity_factor > 0:
        yield "model.capacity_factor", ("capacity is per sequence, and cp > 1 splits sequences over ranks; set it "
                                        "to 0 (no dropping) for context parallel")


def expert_parallel(c: Context):
    lay, m = c.lay, c.model
    if lay.ep == 1:
        return
    if not m.is_moe:
        yield "parallel.ep", "expert parallel needs a mixture-of-experts model (model.n_experts > 0)"
        return
    if m.n_experts % lay.ep:
        yield "parallel.ep", f"model.n_experts={m.n_experts} is not divisible by ep={lay.ep}"
    if lay.shard_degree % lay.ep:
        yield "parallel.ep", (f"ep={lay.ep} must divide dp_shard*cp={lay.shard_degree} (experts are sharded over "
                              f"data-parallel ranks)")


def pipeline(c: Context):
    lay, m = c.lay, c.model
    if lay.pp == 1:
        if lay.pp_virtual_stages != 1:
            yield "parallel.pp_virtual_stages", "virtual stages need pp > 1"
        return
    s = sch.SCHEDULES.get(lay.pp_schedule)
    if s is None:
        return  # reported by `values`
    problem = s.virtual_problem(lay.pp_virtual_stages)
    if problem:
        yield "parallel.pp_virtual_stages", problem
        return
    key = "parallel.layers_per_stage" if lay.layers_per_stage else (
        "parallel.pp_split" if lay.pp_split == "llama3" else "parallel.pp")
    problem = partition_problem(m.n_layers, lay.stages, lay.pp_split, lay.layers_per_stage)
    if problem:
        yield key, problem
    if c.strict:
        if lay.compile and s.split_backward:
            yield "parallel.compile", (f"{s.name} runs the backward in separate input and weight passes, which "
                                       f"compiled blocks do not support; set compile=false or use 1F1B/Interleaved1F1B")
        if lay.activation_checkpoint == "selective" and s.split_backward:
            # torch 2.13's selective checkpointing hands each saved op to one backward only
            # ("Trying to backward an extra time. You are only allowed to backward once on any
            # region computed under selective activation checkpoint"); the weight pass (W) is a
            # second backward over the region. Full checkpointing recomputes and works.
            yield "parallel.activation_checkpoint", (f"{s.name} runs the backward in separate input and weight passes, "
                                                     f"and selective checkpointing allows one backward per region; use "
                                                     f"activation_checkpoint=full or a 1F1B schedule")
        if lay.zero == 2 and lay.shard_degree > 1:
            # torch.distributed.pipelining reduces gradients once, after the last micro-batch:
            # inside a pipeline gradients are never sharded between micro-batches.
            yield "parallel.zero", ("pipeline schedules (torch 2.13) reduce gradients once per step, so zero=2 would "
                                    "run as zero=1: use zero=1 (or zero=3) with pp > 1")


def batch_splits(gb: int, dp: int) -> bool:
    """The batch rule: a global batch of `gb` sequences splits evenly over `dp` data-parallel ranks.
    The one definition: `batches` below (the config check, the plan, `config check`) and the
    planner's search call it. The global batch is the run's, not the layout's: a smaller world
    raises the gradient accumulation, never changes the batch."""
    return gb % dp == 0


def global_batch_problem(gb: int, dp: int, key: str = "train.global_batch") -> str | None:
    """Why a global batch of `gb` sequences cannot be split over `dp` data-parallel ranks."""
    if batch_splits(gb, dp):
        return None
    fits = [d for d in range(1, gb + 1) if gb % d == 0]
    return (f"global batch {gb} ({key}) cannot be split evenly over {dp} data-parallel ranks; the global batch is "
            f"kept when the world changes (gradient accumulation absorbs it), so use a world whose data-parallel "
            f"size divides {gb} (one of {fits}) or change {key}")


def microbatch_split_problem(rows: int, m: int) -> str | None:
    """Why a rank's `rows` sequences cannot run as `m` pipeline micro-batches (stages exchange
    fixed-shape activations, so they must be equal)."""
    if m > rows:
        return f"{m} pipeline micro-batches, but each data-parallel rank has {rows} sequences"
    if rows % m:
        return (f"each data-parallel rank's {rows} sequences do not split into {m} equal pipeline "
                f"micro-batches (stages exchange fixed-shape activations)")
    return None


def batches(c: Context):
    lay = c.lay
    key = "parallel.pp_microbatches" if lay.pp_microbatches else "train.micro_batch"
    s = sch.SCHEDULES.get(lay.pp_schedule)
    for i, gb in enumerate(c.batches):
        key_gb = "train.global_batch" if i == 0 else "train.batch_ramp"
        problem = global_batch_problem(gb, lay.dp, key_gb)
        if problem:
            yield key_gb, problem
            return
        if lay.pp == 1 or s is None or s.virtual_problem(lay.pp_virtual_stages):
            continue
        rows, m = gb // lay.dp, lay.micro_batches(gb)
        problem = microbatch_split_problem(rows, m) or s.microbatch_problem(lay.pp, lay.pp_virtual_stages, m)
        if problem:
            hint = "" if lay.pp_microbatches else " (set train.micro_batch smaller or parallel.pp_microbatches)"
            yield key, f"global batch {gb} in {m} micro-batches: {problem}{hint}"
            return


def offload(c: Context):
    lay = c.lay
    if lay.cpu_offload and lay.dp * lay.cp == 1:
        yield "parallel.cpu_offload", "CPU offload is FSDP's and needs data-parallel ranks (dp_replicate*dp_shard*cp > 1)"


def document_mask(c: Context):
    if c.lay.document_mask and c.lay.pp > 1:
        # Pipeline stages receive hidden states only, so per-row document ids and positions
        # would not reach the later stages.
        yield "data.document_mask", ("document masking does not combine with pipeline parallel (pp > 1) yet; "
                                     "set document_mask=false or pp=1")


def fp8(c: Context):
    from ndtrain.layout import fp8 as fp8_rules

    yield from fp8_rules.fp8_problems(c.lay, c.model, c.seq)


def replicate_sync(c: Context):
    from ndtrain.layout import diloco

    yield from diloco.diloco_problems(c.lay, c.model)


# The rules problems() runs, in order.
RULES: list[Rule] = [values, model_runs_here, tensor_parallel, context_parallel, expert_parallel, pipeline, batches,
                     offload, document_mask, fp8, replicate_sync]


def problems(layout: Layout, model: ModelConfig, world: int | None, seq: int | None = None, batch=None,
             strict: bool = True) -> list[str]:
    """Every reason `layout` cannot train `model` on `world` ranks with sequences of `seq` tokens
    and global batch `batch` (sequences; an int or every global batch of a batch ramp). Empty
    when the runtime builds it. Each item is a `LayoutProblem`: a str with `.key`, the config key to change.

    world=None: the problems every world size would have (what a config shows without a world):
    with all mesh degrees given, the world is their product; with one of them -1, a problem is
    reported only if it remains for every value that degree may take."""
    batches_ = tuple(batch) if isinstance(batch, (list, tuple)) else (() if batch is None else (batch,))
    if world is None:
        return _without_world(layout, model, seq, batches_, strict)
    try:
        lay = fill_degrees(layout, world)
    except DegreeError as exc:
        return [LayoutProblem(exc.key, str(exc))]
    ctx = Context(lay, model, world, seq, batches_, strict)
    out: list[str] = []
    for rule in RULES:
        out.extend(LayoutProblem(key, msg) for key, msg in rule(ctx))
    return out


def _without_world(lay: Layout, model: ModelConfig, seq, batches_, strict: bool) -> list[str]:
    free = [d for d in MESH_ORDER if getattr(lay, d) == -1]
    fixed = 1
    for d in MESH_ORDER:
        fixed *= max(getattr(lay, d), 1)
    if not free:
        return problems(lay, model, fixed, seq, batches_, strict)
    if len(free) > 1 or any(getattr(lay, d) < 1 and getattr(lay, d) != -1 for d in DEGREES):
        try:
            fill_degrees(lay, fixed)
        except DegreeError as exc:
            return [LayoutProblem(exc.key, str(exc))]
    # The values the free degree may take: small ones, powers of two, and the sizes the rules
    # divide by. A problem seen at each of them holds for any world this config could run on.
    cands = set(range(1, 65)) | {1 << k for k in range(15)} | set(batches_)
    cands |= {model.n_experts, max(lay.ep, 1), 2 * max(lay.ep, 1)} - {0}
    common: dict[str, str] | None = None
    for n in sorted(cands):
        found = {p.key: p for p in problems(lay, model, fixed * n, seq, batches_, strict)}
        common = found if common is None else {k: p for k, p in common.items() if k in found}
        if not common:
            return []
    return list(common.values())


def check(layout: Layout, model: ModelConfig, world: int, seq: int | None = None, batch=None) -> Layout:
    """The resolved layout, or ConfigError for its first problem (what the runtime calls)."""
    from ndtrain.errors import ConfigError

    found = problems(layout, model, world, seq, batch)
    if found:
        raise ConfigError(found[0].key, str(found[0]))
    return fill_degrees(layout, world)


__all__ = ["LayoutProblem", "Context", "RULES", "problems", "check"]
