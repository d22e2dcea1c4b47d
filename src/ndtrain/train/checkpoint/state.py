"""The state objects a checkpoint is made of, and how they map onto its files. Each has
`state_dict()` / `load_state_dict()`; the checkpointer (manager.py) takes a mapping of them by
name and knows nothing of who owns them.

- "model" (ModelState) and "optim" (OptimizerState): tensors, written through DCP under those
  keys, with flattened optimizer keys so any layout loads any other's checkpoint (under DiLoCo
  laid out by parallel.diloco's checkpoint view).
- "progress" (TrainProgress): step, tokens seen, data windows to skip; its fields sit at the top
  level of train_state.json (format version 2).
- "loader", "rng" (RNGState), "diloco" (DiLoCoState), and any other: JSON in train_state.json
  under their own name.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from ndtrain.parallel.diloco import checkpoint_restore, checkpoint_view

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
TENSOR_STATES = ("model", "optim")  # through DCP; every other state goes into train_state.json
FLAT_STATE = "progress"  # its fields sit at train_state.json's top level (format version 2)


@dataclass
class TrainProgress:
    """How far training has got. The trainer advances it; the checkpointer saves and restores it."""

    step: int = 0
    tokens_seen: int = 0
    skip_windows: list[list[int]] = field(default_factory=list)  # [start, end) samples dropped after rollbacks
    # The learning-rate schedule the steps follow: {"steps": the train.steps it was made for,
    # "segment": None (the config's) or where an extended run's differs} (optim.extend_schedule).
    lr_schedule: dict | None = None
    # batch_ramp = "auto": the [tokens_seen, global_batch] points it decided, and its noise-scale
    # EMAs (train/noise_scale.py), so a resume continues the same batches and estimate.
    batch_points: list[list[int]] = field(default_factory=list)
    noise_ema: list[float] | None = None
    # balance = "measured": the batch shares it decided (train/balance.py), None: the config's.
    batch_shares: list[float] | None = None

    def add_skip_window(self, window: list[int]) -> None:
        self.skip_windows.append(list(window))

    def window_at(self, consumed: int) -> list[int] | None:
        """The skip window that starts at or before sample `consumed` and ends after it, if any."""
        return next((list(w) for w in self.skip_windows if w[0] <= consumed < w[1]), None)

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "skip_windows": [list(w) for w in self.skip_windows], "lr_schedule": self.lr_schedule,
                "batch_points": [list(p) for p in self.batch_points], "noise_ema": self.noise_ema,
                "batch_shares": self.batch_shares}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.skip_windows = [list(w) for w in state.get("skip_windows", [])]
        self.batch_points = [[int(t), int(b)] for t, b in state.get("batch_points", [])]
        self.noise_ema = state.get("noise_ema")
        shares = state.get("batch_shares")
        self.batch_shares = [float(w) for w in shares] if shares else None
        # A checkpoint from before the record followed its config's schedule over its train.steps.
        steps = state.get("config", {}).get("train", {}).get("steps")
        self.lr_schedule = state.get("lr_schedule") or ({"steps": int(steps), "segment": None} if steps else None)


class RNGState:
    """This process's torch CPU generator, base64 so it fits in JSON."""

    def state_dict(self) -> dict:
        return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}

    def load_state_dict(self, state: dict) -> None:
        rng = state.get("torch")
        if rng:  # older checkpoints may carry none
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))


class ModelState:
    """This rank's model parts as one module (virtual pipeline stages: one view, canonical names).
    Under fp8 the state holds the fp32 masters rather than torchao's wrapper, sharing memory, so
    loading into it writes the live weights."""

    def __init__(self, parts: list[nn.Module], fp8: bool = False):
        self.parts, self.fp8 = list(parts), fp8

    def module(self) -> nn.Module:
        if len(self.parts) == 1:
            return self.parts[0]
        from ndtrain.parallel.pipeline import merged_view

        return merged_view(self.parts)

    def plain(self, sd: dict) -> dict:
        if not self.fp8:
            return sd
        from ndtrain.parallel.float8 import plain_state

        return plain_state(sd)

    def state_dict(self) -> dict:
        return self.plain(get_model_state_dict(self.module(), options=OPTIONS))

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.module(), sd, options=OPTIONS)


class OptimizerState:
    """The optimizer(s) over `model`'s parameters, with flattened (layout-independent) keys."""

    def __init__(self, model: ModelState, optimizers):
        self.model = model
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def state_dict(self) -> dict:
        return self.model.plain(get_optimizer_state_dict(self.model.module(), self.optimizers, options=OPTIONS))

    def load_state_dict(self, sd: dict) -> None:
        set_optimizer_state_dict(self.model.module(), self.optimizers, sd, options=OPTIONS)


class DiLoCoState:
    """DiLoCo's settings and round in train_state.json (what a resume must know before reading any
    tensor). Its tensors ride with the model's: the checkpointer lays them out through
    `parallel.diloco.checkpoint_view` / `checkpoint_restore` with `self.diloco`, which restores
    the outer state from the tensors together with this info."""

    def __init__(self, diloco):
        self.diloco = diloco

    def state_dict(self) -> dict:
        return self.diloco.info()

    def load_state_dict(self, state: dict) -> None:
        pass  # applied with the tensors by checkpoint_restore (it needs both)


# ---- a mapping of states, onto the files and back -------------------------------------------------
def _diloco(states: dict):
    state = states.get("diloco")
    return state.diloco if state is not None else None


def tensor_state(states: dict, saved: dict | None = None) -> dict:
    """The tensors DCP saves, or loads into (`saved`: the train_state.json being loaded)."""
    tensors = {k: states[k].state_dict() for k in TENSOR_STATES if k in states}
    return checkpoint_view(_diloco(states), tensors, saved)  # diloco: global model, outer and inner states


def json_states(states: dict) -> dict:
    """The states train_state.json holds under their own names."""
    return {k: v.state_dict() for k, v in states.items() if k not in (*TENSOR_STATES, FLAT_STATE)}


def load_states(states: dict, tensors: dict, saved: dict) -> None:
    """Every state back from a checkpoint: `tensors` as DCP read them into tensor_state(states,
    saved), `saved` its train_state.json."""
    tensors = checkpoint_restore(_diloco(states), tensors, saved)
    for key in TENSOR_STATES:  # the model before its optimizer
        if key in states:
            states[key].load_state_dict(tensors[key])
    states[FLAT_STATE].load_state_dict(saved)
    for key, obj in states.items():
        if key not in (*TENSOR_STATES, FLAT_STATE) and key in saved:
            obj.load_state_dict(saved[key])


def checkpoint_bytes(state, world_size: int) -> int:
    """This rank's tensor bytes times the world: a checkpoint's size, roughly."""
    return sum(t.numel() * t.element_size() for t in _flat_tensors(state)) * world_size


def _flat_tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _flat_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flat_tensors(v)
    elif isinstance(obj, torch.Tensor):
        yield obj.to_local() if hasattr(obj, "to_local") else obj
