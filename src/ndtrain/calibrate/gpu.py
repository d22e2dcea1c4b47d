"""`ndtrain calibrate` on a GPU node: measure what the planner reads.

On a CUDA GPU (or with --device gpu) it measures what the planner's GPU model needs and writes a
GPU profile (planner/profile.py fits the constants from the raw measurements):
  * GEMM time over shapes, bf16 and (Hopper and later) fp8 through torch._scaled_mm, each the
    median of timed repetitions after warm-up (CUDA events);
  * causal flash attention (SDPA) forward + backward at a few sequence lengths;
  * HBM copy bandwidth;
  * memory the allocator does not see (CUDA context, cuBLAS workspace, NCCL) from
    torch.cuda.mem_get_info, and the caching allocator's slack after a training-like pattern
    (layer activations kept for the backward, freed in reverse, several micro-batches);
  * NCCL all-reduce, all-gather, reduce-scatter, all-to-all and p2p over the node's GPUs at message
    sizes from 4 KiB to 256 MiB (spawned processes, one per GPU), fitted alpha-beta per collective.
Without a GPU (or with --device cpu) the command runs the CPU calibration of "this-machine"
(calibrate/cpu.py) instead. tools/calibrate_command.py writes the profile; the planner, which
never imports torch, only reads it.
"""

from __future__ import annotations

import time

from ndtrain.calibrate.measure import measure_attention, measure_collectives, seconds_per_call
from ndtrain.compat.torch import find, require
from ndtrain.errors import NdtrainError
from ndtrain.planner.hardware import COLLECTIVES, DEFAULT_PROFILE

DEFAULT_GPU_PROFILE = DEFAULT_PROFILE.parent / "gpu.json"  # beside the CPU profile and the host probe
GEMM_SHAPES = [(m, n, k) for m in (1024, 4096, 16384) for n in (1024, 4096, 8192) for k in (512, 2048, 8192)] + \
    [(256, 8192, 8192), (8192, 256, 8192), (8192, 8192, 256), (132 * 128 + 128, 256, 8192)]
COLLECTIVE_SIZES = [1 << p for p in range(12, 29, 2)]  # 4 KiB .. 256 MiB


def _seconds(fn, reps: int) -> float:
    """Median seconds of `fn` on the current CUDA stream, after three calls of warm-up."""
    return seconds_per_call(fn, "cuda", reps, warmup=3)


def measure_gemm(shapes, reps: int, fp8: bool) -> list:
    import torch

    scaled_mm = require("scaled_mm") if fp8 else None  # looked up once, outside the timed calls
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out.append([m, n, k, "bf16", _seconds(lambda: a @ b, reps)])
        if fp8 and m % 16 == 0 and n % 16 == 0 and k % 16 == 0:
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
            one = torch.ones((), device="cuda")
            out.append([m, n, k, "fp8", _seconds(
                lambda: scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps)])
        del a, b
    return out


def measure_hbm(gib: float = 1.0, reps: int = 10) -> dict:
    import torch

    n = int(gib * 2**30) // 4
    src, dst = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    seconds = _seconds(lambda: dst.copy_(src), reps)
    return {"copy_bw": 2 * n * 4 / seconds}


def measure_memory(layers: int = 16, micro_batches: int = 4, mib: int = 64) -> dict:
    """Bytes outside the allocator, and reserved / allocated - 1 after a training-like pattern:
    per micro-batch, each layer keeps a few activations of varied sizes; the backward frees them
    in reverse while gradients of other sizes come and go."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    overhead = total - free - torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    unit = mib * 2**20 // 2
    for _ in range(micro_batches):
        kept = []
        for layer in range(layers):
            kept.append([torch.empty(unit * f // 4, dtype=torch.bfloat16, device="cuda") for f in (4, 3, 7, 2)])
        while kept:
            acts = kept.pop()
            grads = [torch.empty(a.numel() * 5 // 4, dtype=torch.bfloat16, device="cuda") for a in acts[:2]]
            del acts, grads
    peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {"overhead_bytes": overhead, "fragmentation": peak_reserved / max(peak_alloc, 1) - 1,
            "peak_allocated": peak_alloc, "peak_reserved": peak_reserved}


def gpu_collectives(world: int, sizes=COLLECTIVE_SIZES, reps: int = 10) -> dict:
    """NCCL's collectives over this node's `world` GPUs: {"rows": {kind: [[world, bytes, seconds],
    ...]}, "overhead_bytes"} as planner/profile_fit reads them (a p2p row is one pair's: world 2)."""
    got = measure_collectives("cuda", [world], sizes, reps)
    rows: dict = {kind: [] for kind in COLLECTIVES}
    for kind, w, nbytes, seconds in got["samples"]:
        rows[kind].append([2 if kind == "p2p" else w, nbytes, seconds])
    return {"rows": rows, "overhead_bytes": got["overhead_bytes"]}


def _init_context() -> None:
    """This process's CUDA context and cuBLAS workspace, before anything is timed."""
    import torch

    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")


def calibrate_gpu(quick: bool = False):
    """(catalog entry, raw measurements of this GPU node: the dict planner.profile_fit.fit_profile fits)."""
    import torch

    from ndtrain.planner.hardware import CATALOG, catalog_name

    props = torch.cuda.get_device_properties(0)
    name = catalog_name(props.name, props.total_memory)
    if name is None:
        raise NdtrainError(f"{props.name} is not in the planner's catalog ({', '.join(CATALOG)}); "
                           "its constants have no generation to start from")
    hw = CATALOG[name]
    reps = 3 if quick else 10
    shapes = GEMM_SHAPES[::4] if quick else GEMM_SHAPES
    world = torch.cuda.device_count()
    got = None
    if world >= 2:
        # First, before this process allocates on GPU 0: a child's overhead is its GPU's used
        # memory less its own reserved bytes, so this process's context and cached blocks (the
        # GEMM and HBM buffers) were counted as NCCL's. Spawned children start without them.
        torch.cuda.empty_cache()  # a no-op unless a caller already used CUDA in this process
        got = gpu_collectives(world, COLLECTIVE_SIZES[::2] if quick else COLLECTIVE_SIZES, reps)
    _init_context()
    measured = {"device_name": props.name, "gpus": world,
                "calibrated": time.strftime("%Y-%m-%d"), "memory": measure_memory(layers=4 if quick else 16)}
    measured["gemm"] = measure_gemm(shapes, reps, fp8=bool(hw.peak_fp8) and find("scaled_mm") is not None)
    measured["attention"] = measure_attention("cuda", "bf16", (2048,) if quick else (2048, 8192), heads=32,
                                              head_dim=128, tokens=16384, reps=reps, warmup=3)
    measured["hbm"] = measure_hbm(0.25 if quick else 1.0, reps)
    if got is not None:
        measured["collectives"] = got["rows"]
        # with NCCL's communicator and buffers the memory outside the allocator is larger
        measured["memory"]["overhead_bytes"] = max(measured["memory"]["overhead_bytes"], got["overhead_bytes"])
    return hw, measured
