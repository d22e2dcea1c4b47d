"""Run a function on N local ranks with Gloo, from a parent that already imported torch.

Forking is 2-3x faster than spawn or torchrun on this class of machine, and each rank returns
its result through a file (tensors saved with torch.save, read back with weights_only=True).
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args, timeout_s: float):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout_s: float = 120.0) -> list:
    """fn(*args) on `world` forked ranks; returns the per-rank results in rank order."""
    with tempfile.TemporaryDirectory(prefix="ndtrain-ranks-") as out:
        mp.start_processes(_worker, args=(world, free_port(), out, fn, args, timeout_s), nprocs=world,
                           start_method="fork", join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(world)]
