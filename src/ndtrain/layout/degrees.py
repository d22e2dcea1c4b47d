"""What a layout is: the mesh degrees, the ZeRO stage, the pipeline schedule and the per-rank
batch, as one frozen value shared by the config, the runtime, the planner and `verify`.

The mesh is [pp, dp_replicate, dp_shard, cp, tp], outermost first (tp innermost: fastest links).
Expert parallel (ep) is not a mesh dimension: it borrows ranks from data parallel, viewing the
dp_shard x cp ranks (the ZeRO shard group) as (dp_shard x cp / ep) x ep.

The ZeRO stage has the paper's meaning (Rajbhandari et al. 2020) over the shard group
dp_shard x cp, replicated across dp_replicate (HSDP): 1 shards the optimizer state, 2 also the
gradients, 3 also the parameters. When the shard group has one rank nothing is sharded (DDP)
and the stage is moot (`effective_zero` is 0). `reshard_after_forward` is FSDP's own knob and
only means something at stage 3: whether a block's gathered parameters are freed after its
forward (and gathered again for its backward) or kept until the backward.

Layout's fields are the one field list of `[parallel]`'s layout keys (type, default and config
key of each; config/ builds its ParallelConfig from them). Its text syntax is layout/syntax.py's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Literal

from ndtrain.errors import NdtrainError
from ndtrain.layout.schedules import DEFAULT
from ndtrain.model.config import CPU_MATMUL_KERNELS

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, tp innermost
DEGREES = MESH_ORDER + ("ep",)

# The vocabularies, each spelt once: the config's validator (pydantic, on these Literal types),
# the layout rules (rules.py values, through `choices`) and their messages all read them here.
AcPolicy = Literal["none", "full", "every_n", "selective"]
PpSplit = Literal["balanced", "uniform", "llama3"]  # FLOPs + parameters | even | even, one fewer at the ends
Precision = Literal["fp32", "bf16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise"]  # torchao Float8LinearConfig recipe names
CpAttention = Literal["ring", "allgather"]
CpuMatmul = Literal[CPU_MATMUL_KERNELS]  # the kernels model/linear.py implements
Fp32MatmulPrecision = Literal["tf32", "ieee"]  # CUDA's fp32 matmuls: TF32 tensor cores, or IEEE on the CUDA cores
ReplicateSync = Literal["step", "diloco"]
OuterDtype = Literal["fp32", "bf16"]

SPLITS = typing.get_args(PpSplit)  # for layout/partition.py (`choices(name)` gives any field's)
SYNCS = typing.get_args(ReplicateSync)  # for layout/diloco.py

_SAME = object()


@dataclass(frozen=True)
class Key:
    """Where a Layout field lives in the job config, when that is not `[parallel]` (the two keys
    of other sections; the key is always the field's name); `default`: the config's default where
    it differs from a bare Layout's."""

    section: str = "parallel"
    default: object = _SAME


@dataclass(frozen=True)
class Layout:
    """The one field list of `[parallel]`'s layout keys: type, default and (through `Key`) the
    config key of each. config/ builds its ParallelConfig from these fields (`section_fields`)."""

    pp: int = 1
    dp_replicate: int = 1
    # -1: the rest of the world (any one mesh degree may be -1; see fill_degrees). A bare Layout is
    # one rank wide; the config's dp_shard takes the rest of the world unless told otherwise.
    dp_shard: Annotated[int, Key(default=-1)] = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # -1: every rank of the shard group (dp_shard x cp)
    # The ZeRO stage over the shard group dp_shard x cp, in the paper's sense: 1 = optimizer
    # state sharded, 2 = also gradients, 3 = also parameters. Moot when dp_shard x cp = 1 (DDP).
    zero: int = 3
    # ZeRO-3's knob: free a block's gathered parameters after its forward (and gather them again
    # for its backward), or keep them until the backward (more memory, one gather fewer). Not
    # given, it follows the stage (`reshard_default`): true at zero = 3, false at 1 and 2, where
    # parameters are never sharded; true there is refused (layout/rules.py).
    reshard_after_forward: bool = True
    sequence_parallel: bool = True  # sequence parallel, with tp > 1
    micro_batch: Annotated[int, Key(section="train")] = 1  # sequences per rank per forward/backward
    pp_schedule: str = DEFAULT  # a name in layout/schedules.py's registry
    pp_virtual_stages: int = 1  # stages per pipeline rank
    # Pipeline micro-batches per step; 0 = one per micro-batch of the accumulation.
    pp_microbatches: int = 0
    # How layers are split when layers_per_stage is empty (layout/partition.py).
    pp_split: PpSplit = "balanced"
    layers_per_stage: tuple[int, ...] = ()
    activation_checkpoint: AcPolicy = "none"
    ac_every: int = 2  # for every_n: checkpoint every N-th layer
    # fp32 | bf16 (bf16 params/compute, fp32 gradient reduction) | fp8 (bf16, and the qualifying
    # Linear layers' matmuls in float8 through torchao; layout/fp8.py, docs/fp8.md)
    mixed_precision: Precision = "fp32"
    fp8_recipe: Fp8Recipe = "tensorwise"  # with mp = fp8: torchao's scaling recipe
    cpu_offload: bool = False
    compile: bool = False  # torch.compile each decoder block
    # The Linear layers' CPU fp32 kernel (model/linear.py): "onednn" (faster than MKL's on the AMD
    # host measured, docs/results/benchmarks.md) or "blas" (torch's own choice); GPUs and other dtypes
    # are unaffected. "onednn" is the default where nothing chooses (a Trainer without the planner).
    cpu_matmul: CpuMatmul = "onednn"
    # How CUDA runs fp32 matmuls: "tf32" on the tensor cores (inputs rounded to a 10-bit mantissa,
    # fp32 accumulation; ~7x the IEEE rate on A100/H100) or "ieee" on the CUDA cores. CPU ranks
    # have no TF32: their fp32 stays IEEE whichever is set.
    fp32_matmul_precision: Fp32MatmulPrecision = "tf32"
    cp_attention: CpAttention = "ring"
    # attention stays inside each packed document
    document_mask: Annotated[bool, Key(section="data")] = False
    # How dp_replicate replicas agree (layout/diloco.py, docs/diloco.md): "step" all-reduces
    # gradients every step; "diloco" trains each replica alone for `diloco_inner_steps` steps, then
    # takes an outer step, in `diloco_fragments` staggered parameter fragments whose reduction
    # overlaps `diloco_overlap_steps` inner steps.
    replicate_sync: ReplicateSync = "step"
    diloco_inner_steps: int = 8
    diloco_fragments: int = 1
    diloco_overlap_steps: int = 0
    diloco_outer_dtype: OuterDtype = "fp32"  # the outer gradient on the wire

    # ---- derived quantities ----------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Ranks that see different samples (the loader's data-parallel size)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_ORDER)

    @property
    def shard_degree(self) -> int:
        """Ranks over which ZeRO shards dense model states: dp_shard x cp (cp ranks hold the same
        parameters and so shard them too)."""
        return self.dp_shard * self.cp

    @property
    def effective_zero(self) -> int:
        """The ZeRO stage that actually applies: 0 (plain replication) with one rank per shard group."""
        return self.zero if self.shard_degree > 1 else 0

    @property
    def reshards_after_forward(self) -> bool:
        """Whether gathered parameters are freed after each block's forward (ZeRO-3 with FSDP's
        reshard_after_forward). Never under the zero-bubble and V schedules: their weight pass
        (W) finds a stage's parameters through the graph its input pass (I) saw, and resharding
        in between would swap those tensors, so W would lose its gradients."""
        from ndtrain.layout.schedules import SPLIT_BACKWARD

        return (self.effective_zero == 3 and self.reshard_after_forward
                and not (self.pp > 1 and self.pp_schedule in SPLIT_BACKWARD))

    @property
    def grads_sharded_per_microbatch(self) -> bool:
        """Whether gradients are reduce-scattered after every micro-batch (ZeRO-2 and -3), so a
        rank never holds more than its shard of them between micro-batches. ZeRO-1 keeps whole
        gradients and reduces once per step; so does every pipeline, whose schedules (torch
        2.13) reduce after the last micro-batch."""
        return self.effective_zero >= 2 and self.pp == 1

    @property
    def plain_replication(self) -> bool:
        """DDP in the strict sense: data parallelism alone, over ranks that each hold the whole
        model (a shard group of one rank, no tp/cp/pp/ep) and all-reduce whole gradients every
        step (in fp32, on torch's DDP reducer: `on_ddp_reducer`)."""
        return (self.dp_replicate > 1 and self.shard_degree == 1 and self.tp == 1 and self.pp == 1
                and self.ep == 1 and self.replicate_sync == "step")

    def on_ddp_reducer(self, moe: bool = False, precision: str | None = None) -> bool:
        """Whether the runtime runs this layout on torch's DDP reducer rather than FSDP2: plain
        replication in fp32, without CPU offload, of a dense model (`moe`: the model has routed
        experts, which a step may leave without gradient; `precision`: the precision where the caller
        holds it apart from the layout, as the planner's problem does). bf16 stays on FSDP2,
        whose bf16 blocks beat DDP under autocast on CPU (docs/results/history.md, run F). The
        planner prices the reducer's all-reduce with its own in-situ fit where one was calibrated."""
        return self.plain_replication and (precision or self.mixed_precision) == "fp32" and not self.cpu_offload and not moe

    @property
    def pairs_forward_backward(self) -> bool:
        """A pipeline whose schedule pairs a forward with another micro-batch's backward
        (layout/schedules.py: DualPipeV), where expert all-to-alls can overlap compute."""
        from ndtrain.layout.schedules import get

        return self.pp > 1 and get(self.pp_schedule).pairs_forward_backward

    @property
    def expert_shard_degree(self) -> int:
        """Ranks over which ZeRO shards routed-expert states (the shard group divided by ep)."""
        return max(1, self.shard_degree // max(self.ep, 1))

    @property
    def stages(self) -> int:
        return self.pp * self.pp_virtual_stages

    def rows(self, global_batch: int) -> int:
        """Sequences each data-parallel rank processes per step."""
        return global_batch // self.dp

    def micro_batches(self, global_batch: int) -> int:
        """Forward/backward passes per step and rank (pipeline micro-batches when pp > 1)."""
        return microbatch_count(self.pp_microbatches if self.pp > 1 else 0, self.rows(global_batch), self.micro_batch)

    def short(self) -> str:
        """Description for reports, in the text syntax's keys (space-separated): the degrees above 1,
        then what matters with them."""
        keys = [d for d in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep") if getattr(self, d) != 1]
        if self.shard_degree > 1:
            keys.append("zero")
            if self.zero == 3 and not self.reshard_after_forward:
                keys.append("reshard_after_forward")
        if self.pp > 1:
            keys += ["pp_schedule"] + (["pp_virtual_stages"] if self.pp_virtual_stages > 1 else [])
        if self.tp > 1 and not self.sequence_parallel:
            keys.append("sequence_parallel")
        if self.mixed_precision == "fp32" and self.fp32_matmul_precision != "tf32":
            keys.append("fp32_matmul_precision")
        if self.replicate_sync == "diloco":
            keys += ["replicate_sync",
                     "diloco_inner_steps"] + (["diloco_fragments"] if self.diloco_fragments > 1 else [])
        keys += ["micro_batch", "activation_checkpoint"]
        return " ".join(f"{k}={_format(getattr(self, k))}" for k in keys)

    def describe(self) -> str:
        """The mesh degrees above 1, as the runtime logs them."""
        parts = [f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) > 1]
        return " x ".join(parts) if parts else "single"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["sequence_parallel"] = int(self.sequence_parallel and self.tp > 1)
        d["layers_per_stage"] = list(self.layers_per_stage)
        return d

    def text(self, keys=None) -> str:
        """This layout in the `key=value,...` syntax: the given keys, or those off their default."""
        default = Layout()
        keys = keys or [f.name for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(f"{k}={_format(getattr(self, k))}" for k in keys)

    def config_overrides(self, keys=None) -> dict:
        """{section: {key: value}} that make a config build exactly this layout (of the given keys:
        those, the rest left to the config)."""
        out: dict = {}
        for name, section in SECTION.items():
            if keys is not None and name not in keys:
                continue
            value = getattr(self, name)
            out.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
        return out

    def override_args(self) -> list[str]:
        """`--section.key=value` command-line overrides that build this layout from any config:
        the degrees, the ZeRO keys and the micro-batch always, other keys when off their default."""
        default, args = Layout(), []
        always = set(DEGREES) | {"zero", "reshard_after_forward", "micro_batch"}
        for name, section in SECTION.items():
            value = getattr(self, name)
            if value != getattr(default, name) or name in always:
                args.append(f"--{section}.{name}={_format(value, toml=True)}")
        return args


# ---- the field list, read off Layout ---------------------------------------------------------

@dataclass(frozen=True)
class LayoutField:
    name: str  # the Layout attribute, and its key in the job config
    section: str  # the job config section that holds it
    type: object  # the annotation, Key removed
    default: object  # a bare Layout's
    config_default: object  # the config's
    choices: tuple | None  # a Literal type's values (None for other types)


def _read_fields() -> tuple[LayoutField, ...]:
    hints = typing.get_type_hints(Layout, include_extras=True)
    out = []
    for f in dataclasses.fields(Layout):
        hint, key = hints[f.name], Key()
        if typing.get_origin(hint) is Annotated:
            key = next((m for m in hint.__metadata__ if isinstance(m, Key)), key)
            hint = hint.__origin__
        default = f.default
        out.append(LayoutField(f.name, key.section, hint, default,
                               default if key.default is _SAME else key.default,
                               typing.get_args(hint) if typing.get_origin(hint) is Literal else None))
    return tuple(out)


FIELDS = _read_fields()
FIELD = {f.name: f for f in FIELDS}
# Layout field -> the job config section that holds it, under the field's own name.
SECTION = {f.name: f.section for f in FIELDS}


def choices(name: str) -> tuple | None:
    """The values a Literal-typed Layout field may take (None for other fields)."""
    return FIELD[name].choices


def section_fields(section: str) -> list[tuple]:
    """`dataclasses.make_dataclass` specs of the Layout fields a config section holds, under their
    config keys and with the config's defaults (tuples become the lists TOML reads)."""
    out = []
    for f in FIELDS:
        if f.section != section:
            continue
        if f.type == tuple[int, ...]:
            out.append((f.name, list[int], dataclasses.field(default_factory=lambda d=f.config_default: list(d))))
        else:
            out.append((f.name, f.type, dataclasses.field(default=f.config_default)))
    return out


def reshard_default(zero: int) -> bool:
    """reshard_after_forward where it is not given: it follows the ZeRO stage. Stage 3 frees each
    block's gathered parameters after its forward; stages 1 and 2 never shard parameters, so
    there is nothing to free (and true is refused there, layout/rules.py)."""
    return zero not in (1, 2)


def _format(value, toml: bool = False) -> str:
    if isinstance(value, bool):
        return ("true" if value else "false") if toml else str(int(value))
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(str(x) for x in value) + "]"
    return str(value)  # strings unquoted: a value that is not TOML is read as a string


def microbatch_count(pp_microbatches: int, local_rows: int, micro_batch: int) -> int:
    """Micro-batches per step: `[parallel] pp_microbatches` (pipelines), else one per micro-batch
    of the accumulation (this rank's rows / micro_batch, rounded up)."""
    if pp_microbatches > 0:
        return pp_microbatches
    return max(1, -(-local_rows // micro_batch))


# ---- from the runtime config ---------------------------------------------------------------

def from_config(par, train=None, data=None) -> Layout:
    """The Layout of a `[parallel]` section (and `[train]` for the micro-batch, `[data]` for
    document masking). Degrees may still be -1; `fill_degrees` turns them into numbers for a world size."""
    values = {}
    for name, section in SECTION.items():
        src = {"parallel": par, "train": train, "data": data}[section]
        if src is None or not hasattr(src, name):
            continue
        value = getattr(src, name)
        values[name] = tuple(value) if isinstance(value, list) else value
    return Layout(**values)


# ---- -1 degrees ----------------------------------------------------------------------------

class DegreeError(NdtrainError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def fill_degrees(lay: Layout, world: int) -> Layout:
    """Replace -1 degrees by numbers for `world` ranks. At most one mesh degree may be -1; it
    takes what the others leave. ep = -1 takes the whole shard group (dp_shard x cp). Raises
    DegreeError (naming the key) when the world cannot be filled."""
    if lay.pp >= 1 and lay.dp_replicate >= 1 and lay.dp_shard >= 1 and lay.cp >= 1 and lay.tp >= 1 \
            and lay.ep >= 1 and lay.world == world:
        return lay  # nothing to resolve (the planner's hot path)
    degrees = {d: getattr(lay, d) for d in MESH_ORDER}
    for d in DEGREES:
        value = getattr(lay, d)
        if value != -1 and value < 1:
            raise DegreeError(f"parallel.{d}", f"{d} must be >= 1 or -1 (the rest), got {value}")
    free = [d for d, v in degrees.items() if v == -1]
    if len(free) > 1:
        raise DegreeError("parallel", f"at most one mesh degree may be -1, got {', '.join(free)}")
    fixed = 1
    for v in degrees.values():
        fixed *= v if v != -1 else 1
    if free:
        if world % fixed:
            shown = " x ".join(f"{d}={v}" for d, v in degrees.items() if v not in (-1, 1)) or "1"
            raise DegreeError(f"parallel.{free[0]}",
                               f"world size {world} is not divisible by the fixed degrees ({shown} = {fixed}); "
                               f"change [parallel] or the number of processes")
        degrees[free[0]] = world // fixed
    elif fixed != world:
        shown = " x ".join(f"{d}={v}" for d, v in degrees.items())
        raise DegreeError("parallel", f"[parallel] degrees multiply to {fixed} ({shown}) but the world size is "
                                       f"{world}; set one degree to -1 or launch {fixed} processes")
    ep = lay.ep
    if ep == -1:
        ep = degrees["dp_shard"] * degrees["cp"]
    return dataclasses.replace(lay, ep=ep, **degrees)

