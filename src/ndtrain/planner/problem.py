"""What is being planned: a model, a sequence length, a global batch, a world of one hardware type
running one software stack. Shared by the memory and time models."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ndtrain.errors import NdtrainError
from ndtrain.model.config import ModelConfig
from ndtrain.planner.hardware import Hardware, get_hardware
from ndtrain.planner.layout import PRECISIONS, STACKS, Stack
from ndtrain.planner.shapes import Shape, shape_of


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
    strict: bool = False  # only layouts the ndtrain runtime can build (see layout.check_layout)

    @property
    def act_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq


def make_problem(cfg: ModelConfig, seq: int, global_batch: int, world: int, hardware: str | Hardware,
                 stack: str | Stack = "ndtrain", precision: str = "bf16", strict: bool = False,
                 profile: str | None = None) -> Problem:
    if seq < 1 or global_batch < 1 or world < 1:
        raise NdtrainError("seq, global batch and GPU count must be positive")
    if precision not in PRECISIONS:
        raise NdtrainError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    st = stack if isinstance(stack, Stack) else STACKS.get(stack)
    if st is None:
        raise NdtrainError(f"unknown stack {stack!r}; choose one of {', '.join(STACKS)}")
    hw = get_hardware(hardware, profile).for_world(world)
    hw.peak(precision)  # raises for fp8 on hardware without it
    return Problem(cfg=cfg, shape=shape_of(cfg), seq=seq, global_batch=global_batch, world=world, hw=hw,
                   stack=st, precision=precision, strict=strict)


@lru_cache(maxsize=4096)
def partition(layers: int, stages: int, head_layers: float, even: bool) -> tuple[int, int] | None:
    """(layers on each non-last stage at most, layers on the last stage).

    The last stage also runs the output head and loss, worth `head_layers` layers of compute, so
    an uneven split gives it fewer layers (what Llama 3 did for 126 layers on 16 stages). `even`
    is the runtime's rule: equal stages, head on the last. None when the split is impossible.
    """
    if stages == 1:
        return layers, layers
    if even:
        return (layers // stages, layers // stages) if layers % stages == 0 else None
    best = None
    for last in range(math.ceil(layers / stages), 0, -1):
        rest = layers - last
        if rest < stages - 1:
            continue
        other = math.ceil(rest / (stages - 1))
        cost = max(other, last + head_layers)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, other, last)
    return None if best is None else (best[1], best[2])
