"""Process-level setup: device, backend, process group, thread count. Nothing global: the
returned `Runtime` is passed to whatever needs it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ndtrain.errors import NdtrainError


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_device(device: str, backend: str) -> tuple[str, str]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise NdtrainError("train.device='cuda' but no CUDA device is available")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def env_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(train_cfg) -> Runtime:
    """Initialise the process group if launched with WORLD_SIZE > 1 (torchrun) unless a caller
    (a test harness) already did."""
    device_type, backend = choose_device(train_cfg.device, train_cfg.backend)
    world = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=train_cfg.timeout_s))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks sharing a host share its cores; oversubscription is slower than 1 thread each.
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)
