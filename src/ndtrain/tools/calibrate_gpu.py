"""`ndtrain calibrate`: measure this machine and write the profile the planner reads.

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
Without a GPU (or with --device cpu) it runs the CPU calibration of "this-machine"
(ndtrain.tools.calibrate), as before.

The planner itself never imports torch: this module sits on the top floor and only writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ndtrain.compat.torch import find, require
from ndtrain.errors import NdtrainError
from ndtrain.tools.calibrate_measure import KINDS, measure_attention, measure_collectives, seconds_per_call

DEFAULT_GPU_PROFILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ndtrain" / "gpu.json"
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
    rows: dict = {kind: [] for kind in KINDS}
    for kind, w, nbytes, seconds in got["samples"]:
        rows[kind].append([2 if kind == "p2p" else w, nbytes, seconds])
    return {"rows": rows, "overhead_bytes": got["overhead_bytes"]}


def _init_context() -> None:
    """This process's CUDA context and cuBLAS workspace, before anything is timed."""
    import torch

    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")


def calibrate_gpu(quick: bool = False):
    """(catalog entry, raw measurements of this GPU node: the dict planner.profile_fit.build fits)."""
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


def main(argv: list[str]) -> int:
    if any(a == "--from-run" or a.startswith("--from-run=") for a in argv):
        from ndtrain.tools import run_calibrate  # fits recorded runs: no torch, no measuring

        return run_calibrate.main(argv)
    if "--links" in argv:
        from ndtrain.tools import calibrate_links  # under torchrun across nodes: the link between them

        return calibrate_links.cli(argv)
    p = argparse.ArgumentParser(prog="ndtrain calibrate", description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"),
                   help="gpu: measure the GPUs of this node; cpu: this machine's CPU ranks; auto: gpu if CUDA is there")
    p.add_argument("--out", help="profile path (default ~/.cache/ndtrain/gpu.json on a GPU, hardware.json on CPU)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and repetitions")
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    device = args.device
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            if device == "gpu":
                raise NdtrainError("--device gpu: no CUDA device is visible")
            device = "cpu"
        else:
            device = "gpu"
    if device == "cpu" or args.help:
        from ndtrain.tools import calibrate as cpu

        if args.help:
            p.print_help()
            print("\nFit the profile to recorded runs instead of measuring (docs/calibrate-from-runs.md):\n"
                  "  ndtrain calibrate --from-run RUN_DIR [RUN_DIR ...] [--gpu NAME] [--profile BASE] [--out PATH]")
            print("\nAdd the link between nodes to a CPU profile (under torchrun on every node):\n"
                  "  ndtrain calibrate --links [--out PATH] [--quick]")
            print("\nCPU options (this-machine):")
        forwarded = rest + (["--out", args.out] if args.out else []) + (["--quick"] if args.quick else [])
        return cpu.main(forwarded + (["--help"] if args.help else []))
    if rest:
        raise NdtrainError(f"unknown option(s) for the GPU calibration: {' '.join(rest)}")
    from ndtrain.planner import profile_fit as profile
    from ndtrain.tools.calibrate import fit_alpha_beta

    start = time.perf_counter()
    hw, measured = calibrate_gpu(args.quick)
    prof = profile.build(hw, measured, fit_alpha_beta)
    prof["seconds"] = time.perf_counter() - start
    out = Path(args.out or DEFAULT_GPU_PROFILE).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out} ({prof['seconds']:.0f} s): {prof['device_name']} -> catalog {prof['catalog']}")
    for name, value in sorted(prof["constants"].items()):
        print(f"  {name:<14} {value:.4g}")
    for kind, fit in prof["collectives"].items():
        print(f"  {kind:<14} alpha {fit['alpha'] * 1e6:.1f} us, beta {fit['beta'] / 1e9:.1f} GB/s")
    print(f"plan with it: ndtrain plan --gpu {prof['catalog']} --profile {out} ...")
    return 0
