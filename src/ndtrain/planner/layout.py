"""A layout (mesh degrees + micro-batch, schedule, recompute policy), the software stack it runs on,
and the rules that make a layout valid for a model, a world size and a batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ndtrain.errors import NdtrainError
from ndtrain.planner.shapes import Shape

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # two chunks per device, the first and last on device 0
AC_POLICIES = ("none", "selective", "full")
PRECISIONS = {"bf16": 2, "fp8": 2, "fp32": 4}  # bytes per activation / parameter copy


@dataclass(frozen=True)
class Stack:
    """What the training software does, as far as cost goes. Not fitted: each flag is a fact
    about the code base (documented in docs/planner.md)."""

    name: str
    flash_attention: bool  # no s x s scores stored; causal kernels skip the masked half
    dropout: bool  # 1-byte masks after attention and MLP (GPT-era models)
    dp_overlap: bool  # gradient reduction overlaps the backward pass
    grad_reduce_bytes: int  # bytes per gradient element on the wire
    selective_mlp: bool  # selective recompute also recomputes the MLP activation function


STACKS = {
    # ndtrain: SDPA flash kernels, no dropout, FSDP2/DDP with overlapped fp32 gradient reduction
    # (parallel.mixed_precision=bf16 reduces in fp32).
    "ndtrain": Stack("ndtrain", flash_attention=True, dropout=False, dp_overlap=True, grad_reduce_bytes=4,
                     selective_mlp=True),
    # Megatron-LM as of Narayanan et al. 2021: unfused softmax over s x s with dropout, fp16
    # gradients all-reduced after the backward pass (the local DDP of that release).
    "megatron-2021": Stack("megatron-2021", flash_attention=False, dropout=True, dp_overlap=False,
                           grad_reduce_bytes=2, selective_mlp=False),
}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 3  # sharding stage over dp_shard (x cp); irrelevant when nothing is sharded
    mb: int = 1  # micro-batch size in sequences
    v: int = 1  # model chunks per pipeline rank
    ac: str = "none"
    sp: bool = True  # sequence parallel (only meaningful with tp > 1)
    schedule: str = "1F1B"

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def shard_degree(self) -> int:
        """Ranks over which ZeRO shards dense model states (FSDP folds cp into the shard group)."""
        return self.dp_shard * self.cp if self.dp_shard > 1 else 1

    @property
    def eff_zero(self) -> int:
        return self.zero if self.shard_degree > 1 else 0

    def micro_batches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mb)

    def short(self) -> str:
        parts = []
        for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"):
            if getattr(self, key) > 1:
                parts.append(f"{key}={getattr(self, key)}")
        if self.shard_degree > 1:
            parts.append(f"zero={self.zero}")
        if self.pp > 1:
            parts.append(f"{self.schedule}" + (f" v={self.v}" if self.v > 1 else ""))
        if self.tp > 1 and not self.sp:
            parts.append("sp=0")
        parts += [f"mb={self.mb}", f"ac={self.ac}"]
        return " ".join(parts)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["sp"] = int(self.sp and self.tp > 1)
        return d


def canonical_schedule(name: str) -> str:
    for s in SCHEDULES:
        if s.lower() == name.lower().replace("-", "").replace("_", ""):
            return s
    raise NdtrainError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def parse_layout(text: str | dict, world: int) -> Layout:
    """`tp=8,pp=16,dp_shard=64,mb=1,ac=full,schedule=Interleaved1F1B,v=2`. Degrees not given are
    1, except dp_shard, which takes the rest of the world (as `[parallel] dp_shard = -1` does)."""
    if isinstance(text, dict):
        items = {str(k): str(v) for k, v in text.items()}
    else:
        items = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise NdtrainError(f"--layout: bad item {item!r} (expected key=value)")
            items[key.strip().lower()] = value.strip()
    aliases = {"micro_batch": "mb", "virtual_stages": "v", "pp_virtual_stages": "v", "pp_schedule": "schedule",
               "activation_checkpoint": "ac", "sequence_parallel": "sp"}
    items = {aliases.get(k, k): v for k, v in items.items()}
    ints = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "zero", "mb", "v", "sp")
    known = set(ints) | {"ac", "schedule"}
    unknown = sorted(set(items) - known)
    if unknown:
        raise NdtrainError(f"--layout: unknown key {unknown[0]!r}; keys are {', '.join(sorted(known))}")
    vals: dict = {}
    for key in ints:
        if key in items:
            try:
                vals[key] = int(items[key])
            except ValueError as exc:
                raise NdtrainError(f"--layout: {key}={items[key]!r} is not an integer") from exc
    if "ac" in items:
        vals["ac"] = items["ac"].lower()
        if vals["ac"] not in AC_POLICIES:
            raise NdtrainError(f"--layout: ac must be one of {', '.join(AC_POLICIES)}, got {items['ac']!r}")
    if "sp" in vals:
        vals["sp"] = bool(vals["sp"])
    if "schedule" in items:
        vals["schedule"] = canonical_schedule(items["schedule"])
    elif vals.get("v", 1) > 1:
        vals["schedule"] = "Interleaved1F1B"
    if vals.get("schedule") in V_SHAPED:
        vals.setdefault("v", 2)
    rest = 1
    for key in ("dp_replicate", "tp", "cp", "pp"):
        rest *= max(1, vals.get(key, 1))
    if vals.get("dp_shard", -1) == -1:
        if world % rest:
            raise NdtrainError(f"--layout: {world} GPUs are not divisible by dp_replicate*tp*cp*pp = {rest}")
        vals["dp_shard"] = world // rest
    return Layout(**vals)


def check_layout(lay: Layout, shape: Shape, world: int, global_batch: int, seq: int,
                 strict: bool = False) -> str | None:
    """Why `lay` cannot run, or None. strict=True applies the runtime's extra rules (even pipeline
    stages, tp dividing kv heads) that the planner otherwise relaxes as Megatron does."""
    for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "mb", "v"):
        if getattr(lay, key) < 1:
            return f"{key} must be >= 1"
    if lay.world != world:
        return f"dp_replicate*dp_shard*tp*cp*pp = {lay.world}, not the {world} GPUs"
    if lay.zero not in (1, 2, 3):
        return "zero must be 1, 2 or 3"
    if lay.ac not in AC_POLICIES:
        return f"ac must be one of {', '.join(AC_POLICIES)}"
    if shape.heads % lay.tp:
        return f"tp={lay.tp} does not divide {shape.heads} attention heads"
    if shape.kv_heads % lay.tp and (strict or lay.tp % shape.kv_heads):
        return f"tp={lay.tp} does not divide {shape.kv_heads} kv heads"
    if lay.cp > 1 and seq % (2 * lay.cp):
        return f"seq {seq} is not divisible by 2*cp = {2 * lay.cp} (load-balanced causal split)"
    if lay.ep > 1:
        if not shape.n_experts:
            return "ep > 1 needs a mixture-of-experts model"
        if shape.n_experts % lay.ep:
            return f"ep={lay.ep} does not divide {shape.n_experts} experts"
        if (lay.dp_shard * lay.cp) % lay.ep:
            return f"ep={lay.ep} must divide dp_shard*cp = {lay.dp_shard * lay.cp} (experts borrow data-parallel ranks)"
    if global_batch % (lay.dp * lay.mb):
        return f"global batch {global_batch} is not divisible by dp*mb = {lay.dp * lay.mb}"
    m = lay.micro_batches(global_batch)
    if lay.pp == 1:
        return None if lay.v == 1 else "v > 1 needs pp > 1"
    if lay.schedule not in SCHEDULES:
        return f"unknown schedule {lay.schedule!r}"
    chunks = lay.pp * lay.v
    if chunks > shape.layers:
        return f"pp*v = {chunks} chunks exceed {shape.layers} layers"
    if strict and shape.layers % chunks:
        return f"pp*v = {chunks} does not divide {shape.layers} layers"
    if lay.schedule in ("GPipe", "1F1B") and lay.v != 1:
        return f"{lay.schedule} runs one chunk per rank (v=1)"
    if lay.schedule in INTERLEAVED:
        if lay.v < 2:
            return f"{lay.schedule} needs v >= 2"
        if m % lay.pp:
            return f"{lay.schedule} needs micro-batches ({m}) divisible by pp={lay.pp}"
    if lay.schedule in V_SHAPED and lay.v != 2:
        return f"{lay.schedule} runs exactly two chunks per rank (v=2)"
    need = 2 * lay.pp if lay.schedule == "DualPipeV" else (1 if lay.schedule == "GPipe" else lay.pp)
    if m < need:
        return f"{lay.schedule} needs at least {need} micro-batches, the batch gives {m}"
    return None
