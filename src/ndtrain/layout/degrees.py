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

One text syntax for a layout everywhere (`plan --layout`, `--fix`, `verify --layouts`,
`config check`): `key=value` items joined by commas, e.g. `tp=2,pp=4,zero=1,schedule=ZBVZeroBubble`.
Keys are the `[parallel]` names or their short forms below; `mb` is `[train] micro_batch`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ndtrain.errors import NdtrainError
from ndtrain.layout.schedules import DEFAULT, DEFAULT_INTERLEAVED

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first, tp innermost
DEGREES = MESH_ORDER + ("ep",)
AC_POLICIES = ("none", "full", "every_n", "selective")
SPLITS = ("balanced", "uniform", "llama3")
PRECISIONS = ("fp32", "bf16", "fp8")
CP_ATTENTION = ("ring", "allgather")
FP32_MATMUL_PRECISIONS = ("tf32", "ieee")  # CUDA's fp32 matmuls: TF32 tensor cores, or IEEE on the CUDA cores

# Layout field -> (config section, config key). The one mapping between the two vocabularies.
CONFIG_KEYS = {
    "pp": ("parallel", "pp"), "dp_replicate": ("parallel", "dp_replicate"), "dp_shard": ("parallel", "dp_shard"),
    "cp": ("parallel", "cp"), "tp": ("parallel", "tp"), "ep": ("parallel", "ep"), "zero": ("parallel", "zero"),
    "reshard_after_forward": ("parallel", "reshard_after_forward"), "sp": ("parallel", "sequence_parallel"),
    "schedule": ("parallel", "pp_schedule"), "v": ("parallel", "pp_virtual_stages"),
    "m": ("parallel", "pp_microbatches"), "split": ("parallel", "pp_split"),
    "layers_per_stage": ("parallel", "layers_per_stage"), "ac": ("parallel", "activation_checkpoint"),
    "ac_every": ("parallel", "ac_every"), "mp": ("parallel", "mixed_precision"),
    "offload": ("parallel", "cpu_offload"), "compile": ("parallel", "compile"),
    "cp_attention": ("parallel", "cp_attention"), "fp8_recipe": ("parallel", "fp8_recipe"),
    "cpu_matmul": ("parallel", "cpu_matmul"), "fp32_matmul_precision": ("parallel", "fp32_matmul_precision"),
    "mb": ("train", "micro_batch"), "doc_mask": ("data", "document_mask"),
    "sync": ("parallel", "replicate_sync"), "inner_steps": ("parallel", "diloco_inner_steps"),
    "fragments": ("parallel", "diloco_fragments"), "overlap": ("parallel", "diloco_overlap_steps"),
    "outer_dtype": ("parallel", "diloco_outer_dtype"),
}
# Other names accepted in the text syntax: the config keys themselves, and a few short forms.
ALIASES = {**{key: name for name, (_, key) in CONFIG_KEYS.items()},
           "micro_batch": "mb", "virtual_stages": "v", "raf": "reshard_after_forward",
           "mixed_precision": "mp", "precision": "mp", "cpu_offload": "offload"}


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1  # -1: the rest of the world (any one mesh degree may be -1; see resolve)
    cp: int = 1
    tp: int = 1
    ep: int = 1  # -1: every rank of the shard group (dp_shard x cp)
    zero: int = 3
    reshard_after_forward: bool = True  # zero = 3 only
    sp: bool = True  # sequence parallel, with tp > 1
    mb: int = 1  # micro-batch: sequences per rank per forward/backward
    schedule: str = DEFAULT
    v: int = 1  # stages per pipeline rank
    m: int = 0  # pipeline micro-batches per step; 0 = one per micro-batch of the accumulation
    split: str = "balanced"
    layers_per_stage: tuple = ()
    ac: str = "none"
    ac_every: int = 2
    mp: str = "fp32"  # mixed precision: fp32 | bf16 | fp8 (bf16 with float8 matmuls, layout/fp8.py)
    fp8_recipe: str = "tensorwise"  # with mp = fp8: torchao's scaling recipe (tensorwise | rowwise)
    offload: bool = False
    compile: bool = False
    cpu_matmul: str = "onednn"  # the Linear layers' CPU fp32 kernel: onednn | blas (model/linear.py)
    fp32_matmul_precision: str = "tf32"  # CUDA's fp32 matmuls: tf32 | ieee (CPU ranks have no TF32)
    cp_attention: str = "ring"
    doc_mask: bool = False  # [data] document_mask: attention stays inside each packed document
    # How dp_replicate replicas agree (layout/diloco.py): "step" all-reduces gradients every step;
    # "diloco" trains each replica alone for `inner_steps` steps, then takes an outer step, in
    # `fragments` staggered parameter fragments whose reduction overlaps `overlap` inner steps.
    sync: str = "step"
    inner_steps: int = 8
    fragments: int = 1
    overlap: int = 0
    outer_dtype: str = "fp32"  # dtype of the outer gradient on the wire

    # ---- derived quantities ----------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Ranks that see different samples (the loader's data-parallel size)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    world_size = world

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
                and not (self.pp > 1 and self.schedule in SPLIT_BACKWARD))

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
                and self.ep == 1 and self.sync == "step")

    def on_ddp_reducer(self, moe: bool = False, mp: str | None = None) -> bool:
        """Whether the runtime runs this layout on torch's DDP reducer rather than FSDP2: plain
        replication in fp32, without CPU offload, of a dense model (`moe`: the model has routed
        experts, which a step may leave without gradient; `mp`: the precision where the caller
        holds it apart from the layout, as the planner's problem does). bf16 stays on FSDP2,
        whose bf16 blocks beat DDP under autocast on CPU (docs/benchmarks.md, run F). The
        planner prices the reducer's all-reduce with its own in-situ fit where one was calibrated."""
        return self.plain_replication and (mp or self.mp) == "fp32" and not self.offload and not moe

    @property
    def pairs_forward_backward(self) -> bool:
        """A pipeline whose schedule pairs a forward with another micro-batch's backward
        (layout/schedules.py: DualPipeV), where expert all-to-alls can overlap compute."""
        from ndtrain.layout.schedules import get

        return self.pp > 1 and get(self.schedule).pairs_forward_backward

    @property
    def expert_shard_degree(self) -> int:
        """Ranks over which ZeRO shards routed-expert states (the shard group divided by ep)."""
        return max(1, self.shard_degree // max(self.ep, 1))

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def rows(self, global_batch: int) -> int:
        """Sequences each data-parallel rank processes per step."""
        return global_batch // self.dp

    def micro_batches(self, global_batch: int) -> int:
        """Forward/backward passes per step and rank (pipeline micro-batches when pp > 1)."""
        return microbatch_count(self.m if self.pp > 1 else 0, self.rows(global_batch), self.mb)

    def short(self) -> str:
        """Compact description for reports: the degrees above 1, then what matters with them."""
        parts = [f"{d}={getattr(self, d)}" for d in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
                 if getattr(self, d) != 1]
        if self.shard_degree > 1:
            parts.append(f"zero={self.zero}")
            if self.zero == 3 and not self.reshard_after_forward:
                parts.append("raf=0")
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.v}" if self.v > 1 else ""))
        if self.tp > 1 and not self.sp:
            parts.append("sp=0")
        if self.mp == "fp32" and self.fp32_matmul_precision != "tf32":
            parts.append(f"fp32_matmul={self.fp32_matmul_precision}")
        if self.sync == "diloco":
            parts.append(f"diloco H={self.inner_steps}" + (f" F={self.fragments}" if self.fragments > 1 else ""))
        parts += [f"mb={self.mb}", f"ac={self.ac}"]
        return " ".join(parts)

    def describe(self) -> str:
        """The mesh degrees above 1, as the runtime logs them."""
        parts = [f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) > 1]
        return " x ".join(parts) if parts else "single"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["sp"] = int(self.sp and self.tp > 1)
        d["layers_per_stage"] = list(self.layers_per_stage)
        return d

    def text(self, keys=None) -> str:
        """This layout in the `key=value,...` syntax: the given keys, or those off their default."""
        default = Layout()
        keys = keys or [f.name for f in dataclasses.fields(self)
                        if getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(f"{k}={_format(getattr(self, k))}" for k in keys)

    def config_overrides(self) -> dict:
        """{section: {key: value}} that make a config build exactly this layout."""
        out: dict = {}
        for name, (section, key) in CONFIG_KEYS.items():
            value = getattr(self, name)
            out.setdefault(section, {})[key] = list(value) if isinstance(value, tuple) else value
        return out

    def override_args(self) -> list[str]:
        """`--section.key=value` command-line overrides that build this layout from any config:
        the degrees, the ZeRO keys and the micro-batch always, other keys when off their default."""
        default, args = Layout(), []
        always = set(DEGREES) | {"zero", "reshard_after_forward", "mb"}
        for name, (section, key) in CONFIG_KEYS.items():
            value = getattr(self, name)
            if value != getattr(default, name) or name in always:
                args.append(f"--{section}.{key}={_format(value, toml=True)}")
        return args


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
    document masking). Degrees may still be -1; `resolve` turns them into numbers for a world size."""
    values = {}
    for name, (section, key) in CONFIG_KEYS.items():
        src = {"parallel": par, "train": train, "data": data}[section]
        if src is None or not hasattr(src, key):
            continue
        value = getattr(src, key)
        values[name] = tuple(value) if isinstance(value, list) else value
    return Layout(**values)


# ---- the text syntax -----------------------------------------------------------------------

_INTS = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "zero", "mb", "v", "m", "ac_every", "inner_steps",
         "fragments", "overlap"}
_BOOLS = {"reshard_after_forward", "sp", "offload", "compile", "doc_mask"}


def parse_items(text: str | dict, what: str = "layout") -> dict:
    """`key=value,...` (or a dict) -> {Layout field: typed value}. Unknown keys and bad values
    raise NdtrainError naming the item."""
    if isinstance(text, dict):
        raw = {str(k).strip().lower(): v for k, v in text.items()}
    else:
        raw = {}
        for item in filter(None, (p.strip() for p in _split_items(text))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise NdtrainError(f"{what}: bad item {item!r} (expected key=value, items joined by commas)")
            raw[key.strip().lower()] = value.strip()
    out: dict = {}
    for key, value in raw.items():
        name = ALIASES.get(key, key)
        if name not in CONFIG_KEYS:
            known = ", ".join(sorted(CONFIG_KEYS))
            raise NdtrainError(f"{what}: unknown key {key!r}; keys are {known} (or their [parallel] names)")
        out[name] = _typed(name, value, what)
    return out


def _split_items(text: str) -> list[str]:
    """Split on commas outside brackets, so `layers_per_stage=[3,5,5,3]` stays one item."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur]


def _typed(name: str, value, what: str):
    text = str(value).strip()
    if name in _INTS:
        if isinstance(value, bool):
            raise NdtrainError(f"{what}: {name}={value!r} is not an integer")
        try:
            return int(value) if isinstance(value, int) else int(text)
        except ValueError:
            raise NdtrainError(f"{what}: {name}={text!r} is not an integer") from None
    if name in _BOOLS:
        if isinstance(value, bool):
            return value
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise NdtrainError(f"{what}: {name}={text!r} is not a boolean (use 1/0 or true/false)")
    if name == "layers_per_stage":
        items = value if isinstance(value, (list, tuple)) else text.strip("[]").replace(" ", "").split(",")
        try:
            return tuple(int(x) for x in items if str(x) != "")
        except ValueError:
            raise NdtrainError(f"{what}: layers_per_stage={text!r} is not a list of integers") from None
    if name == "schedule":
        from ndtrain.layout.schedules import canonical_schedule

        return canonical_schedule(text)
    lowered = ("ac", "mp", "split", "cp_attention", "cpu_matmul", "fp32_matmul_precision", "fp8_recipe", "sync",
               "outer_dtype")
    return text.lower() if name in lowered else text


def parse_layout(text: str | dict, world: int | None = None, base: Layout | None = None) -> Layout:
    """A Layout from the text syntax, on top of `base` (default: all degrees 1 except dp_shard,
    which takes the rest of the world, as `[parallel] dp_shard = -1` does). With `world` the
    -1 degrees are resolved (and a world the degrees cannot fill is an error).

    Convenience defaults, as a user would expect: `v` defaults to 2 for the V schedules, and a
    `v` above 1 without a schedule means Interleaved1F1B; at ZeRO-1/2 `reshard_after_forward`
    is false (parameters stay gathered)."""
    items = parse_items(text)
    base = base or Layout(dp_shard=-1)
    if "schedule" not in items and items.get("v", 1) > 1:
        items["schedule"] = DEFAULT_INTERLEAVED
    from ndtrain.layout.schedules import SCHEDULES

    sched = SCHEDULES.get(items.get("schedule", base.schedule))
    if sched is not None and sched.fixed_v and "v" not in items:
        items["v"] = sched.fixed_v
    if items.get("zero", base.zero) in (1, 2) and "reshard_after_forward" not in items:
        items["reshard_after_forward"] = False
    lay = dataclasses.replace(base, **items)
    return resolve(lay, world) if world is not None else lay


# ---- -1 degrees ----------------------------------------------------------------------------

class ResolveError(NdtrainError):
    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def resolve(lay: Layout, world: int) -> Layout:
    """Replace -1 degrees by numbers for `world` ranks. At most one mesh degree may be -1; it
    takes what the others leave. ep = -1 takes the whole shard group (dp_shard x cp). Raises
    ResolveError (naming the key) when the world cannot be filled."""
    if lay.pp >= 1 and lay.dp_replicate >= 1 and lay.dp_shard >= 1 and lay.cp >= 1 and lay.tp >= 1 \
            and lay.ep >= 1 and lay.world == world:
        return lay  # nothing to resolve (the planner's hot path)
    degrees = {d: getattr(lay, d) for d in MESH_ORDER}
    for d in DEGREES:
        value = getattr(lay, d)
        if value != -1 and value < 1:
            raise ResolveError(f"parallel.{d}", f"{d} must be >= 1 or -1 (the rest), got {value}")
    free = [d for d, v in degrees.items() if v == -1]
    if len(free) > 1:
        raise ResolveError("parallel", f"at most one mesh degree may be -1, got {', '.join(free)}")
    fixed = 1
    for v in degrees.values():
        fixed *= v if v != -1 else 1
    if free:
        if world % fixed:
            shown = " x ".join(f"{d}={v}" for d, v in degrees.items() if v not in (-1, 1)) or "1"
            raise ResolveError(f"parallel.{free[0]}",
                               f"world size {world} is not divisible by the fixed degrees ({shown} = {fixed}); "
                               f"change [parallel] or the number of processes")
        degrees[free[0]] = world // fixed
    elif fixed != world:
        shown = " x ".join(f"{d}={v}" for d, v in degrees.items())
        raise ResolveError("parallel", f"[parallel] degrees multiply to {fixed} ({shown}) but the world size is "
                                       f"{world}; set one degree to -1 or launch {fixed} processes")
    ep = lay.ep
    if ep == -1:
        ep = degrees["dp_shard"] * degrees["cp"]
    return dataclasses.replace(lay, ep=ep, **degrees)
