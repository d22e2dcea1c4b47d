"""What is being planned: a model, a sequence length, a global batch, a world of one hardware type
running one software stack. Shared by the memory and time models, and the one place the planner
asks ndtrain.layout whether a layout is valid."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout, problems
from ndtrain.layout import schedules as registry
from ndtrain.layout.flops import layer_forward_flops
from ndtrain.layout.partition import partition_problem, pipeline_split, rank_layer_counts
from ndtrain.model.config import ModelConfig
from ndtrain.planner import constants as consts
from ndtrain.planner.accelerator import GiB, Hardware
from ndtrain.planner.profile import hardware_for
from ndtrain.planner.shapes import Shape, shape_of
from ndtrain.planner.stack import PRECISIONS, STACKS, Stack


@dataclass
class Problem:
    cfg: ModelConfig
    shape: Shape
    seq: int
    global_batch: int  # sequences per optimizer step
    world: int
    hw: Hardware
    stack: Stack
    precision: str = "bf16"
    # True: only layouts the ndtrain runtime builds (problems() strict). False also admits what
    # only other runtimes build (published Megatron-LM layouts: kv-head replication, GeLU MLPs).
    strict: bool = True
    # The constants of the time and memory models (planner/constants.py), resolved for this GPU
    # generation; a sampled world (planner/uncertainty.py) is this problem with other values.
    k: dict = field(default_factory=dict)

    @property
    def act_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def gpu(self) -> bool:
        """An accelerator (the mechanistic model); False for calibrated CPU ranks."""
        return self.hw.generation != "cpu"

    @property
    def overhead_bytes(self) -> float:
        return self.k["overhead_gib"] * GiB if self.gpu else self.hw.overhead_bytes

    def with_constants(self, values: dict) -> "Problem":
        """This problem in another world: the same run with other constants."""
        return dataclasses.replace(self, k={**self.k, **values})

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def why_invalid(self, lay: Layout) -> str | None:
        """The first of ndtrain.layout.problems() for this layout, or None: the planner's only
        validity rule. A `Problem` (a str whose `.key` is the config key it is about)."""
        found = problems(lay, self.cfg, self.world, self.seq, self.global_batch, self.strict)
        return found[0] if found else None

    def lifted_by_relaxed(self, lay: Layout) -> bool:
        """Whether only the strict runtime's rules refuse `lay` (`--relaxed` admits it)."""
        return self.strict and not problems(lay, self.cfg, self.world, self.seq, self.global_batch, False)


def make_problem(cfg: ModelConfig, seq: int, global_batch: int, world: int, hardware: str | Hardware,
                 stack: str | Stack = "ndtrain", precision: str = "bf16", strict: bool = True,
                 profile: str | None = None, constants: dict | None = None, network: dict | None = None,
                 power_w: float = 0.0) -> Problem:
    """`profile`: for "this-machine" its calibration; for a catalog GPU a GPU calibration profile
    (`ndtrain calibrate` on that GPU), whose measured constants replace the catalog's. `constants`
    overrides constants by name; `network` the network as built (planner/accelerator.py:
    gpus_per_node, pod_gpus, oversubscription, nic_bw in bytes/s); `power_w` the board power
    limit the GPUs are held to (0: their TDP)."""
    if seq < 1 or global_batch < 1 or world < 1:
        raise NdtrainError("seq, global batch and GPU count must be positive")
    if precision not in PRECISIONS:
        raise NdtrainError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    st = stack if isinstance(stack, Stack) else STACKS.get(stack)
    if st is None:
        raise NdtrainError(f"unknown stack {stack!r}; choose one of {', '.join(STACKS)}")
    hw = hardware_for(hardware, profile).for_world(world)
    if network:
        hw = dataclasses.replace(hw, **network)
    if power_w:
        # nvidia-smi accepts limits from about 30% of the TDP (200 of 700 W on H100 SXM) up to it
        if hw.generation == "cpu" or not 0.3 * hw.tdp_w <= power_w <= hw.tdp_w:
            raise NdtrainError(f"--power-limit {power_w:g} W: " + (
                "CPU ranks have no board power limit" if hw.generation == "cpu" else
                f"{hw.name} accepts {0.3 * hw.tdp_w:.0f}-{hw.tdp_w:.0f} W (its TDP)"))
        hw = dataclasses.replace(hw, power_w=float(power_w))
    hw.peak(precision)  # raises for fp8 on hardware without it
    if hw.generation == "cpu":
        k = {"fragmentation": FRAGMENTATION_CPU}
    else:
        k = consts.resolve(hw.generation, {**hw.measured, **(constants or {})})
    return Problem(cfg=cfg, shape=shape_of(cfg), seq=seq, global_batch=global_batch, world=world, hw=hw,
                   stack=st, precision=precision, strict=strict, k=k)


FRAGMENTATION_CPU = 0.10  # the CPU model's allocator slack (unchanged from its calibration)


@dataclass(frozen=True)
class Split:
    """Where a layout's layers live: per pipeline rank, from the runtime's stage partition."""

    ranks: tuple[int, ...]  # layers per pipeline rank
    head_rank: int  # the rank holding the last stage (norm, head, loss); the embedding is on rank 0
    counts: tuple[int, ...]  # layers per stage (what `[parallel] layers_per_stage` would say)
    work: tuple[float, ...] = ()  # per rank, its layers' FLOPs in average layers (dense layers of an MoE model are lighter)

    @property
    def first(self) -> int:
        """Layers on the fullest rank without the head (rank 0's role: most micro-batches in flight)."""
        others = [n for r, n in enumerate(self.ranks) if r != self.head_rank]
        return max(others) if others else self.ranks[0]

    @property
    def last(self) -> int:
        return self.ranks[self.head_rank]

    @property
    def first_work(self) -> float:
        others = [w for r, w in enumerate(self.work) if r != self.head_rank]
        return max(others) if others else self.work[0]

    @property
    def last_work(self) -> float:
        return self.work[self.head_rank]


def stage_split(pb: Problem, lay: Layout) -> Split | None:
    """The layers per pipeline rank the runtime would build (None when impossible)."""
    L = pb.cfg.n_layers
    if lay.pp == 1:
        return Split((L,), 0, (L,), (float(L),))
    if partition_problem(L, lay.stages, lay.pp_split, lay.layers_per_stage):
        return None
    counts = pipeline_split(pb.cfg, pb.seq, lay)
    owners = registry.get(lay.pp_schedule).stage_ranks(lay.pp, lay.pp_virtual_stages)
    weight = _layer_weights(pb)
    work, start = [0.0] * lay.pp, 0
    for stage, c in enumerate(counts):
        work[owners[stage]] += sum(weight[start:start + c])
        start += c
    return Split(tuple(rank_layer_counts(counts, owners, lay.pp)), owners[-1], tuple(counts), tuple(work))


def _layer_weights(pb: Problem) -> list[float]:
    """Each layer's forward FLOPs over the average layer's (1.0 for every layer of a dense model)."""
    cached = pb.__dict__.get("_layer_weights")
    if cached is None:
        flops = [layer_forward_flops(pb.cfg, i, pb.seq) for i in range(pb.cfg.n_layers)]
        mean = sum(flops) / len(flops)
        cached = pb.__dict__["_layer_weights"] = [f / mean for f in flops]
    return cached
