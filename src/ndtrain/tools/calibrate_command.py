"""`ndtrain calibrate`: measure this machine and write the profile the planner reads.

The command's options, and what it writes and prints; the measuring is the calibrate/ package's
(torch), the fitting the planner's (torch-free). Four ways in: a GPU node (calibrate/gpu.py), CPU
ranks (calibrate/cpu.py), the link between nodes under torchrun (`--links`, calibrate/links.py),
and recorded runs instead of measuring (`--from-run`, tools/run_calibrate.py). torch is imported
only on the paths that measure, so `--from-run` fits on a machine without it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.paths import check_output_file
from ndtrain.planner.hardware import DEFAULT_PROFILE

DESCRIPTION = "`ndtrain calibrate`: measure this machine and write the profile the planner reads."
CPU_DESCRIPTION = ("`ndtrain calibrate`: measure this machine and write the hardware profile the planner's\n"
                   "\"this-machine\" entry loads.")
LINKS_DESCRIPTION = "`ndtrain calibrate --links`: the link between nodes, measured apart from the link inside one."


def main(argv: list[str]) -> int:
    if any(a == "--from-run" or a.startswith("--from-run=") for a in argv):
        from ndtrain.tools import run_calibrate  # fits recorded runs: no torch, no measuring

        return run_calibrate.main(argv)
    if "--links" in argv:
        return links_main(argv)  # under torchrun across nodes: the link between them
    p = argparse.ArgumentParser(prog="ndtrain calibrate", description=DESCRIPTION, add_help=False)
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
        if args.help:
            p.print_help()
            print("\nFit the profile to recorded runs instead of measuring (docs/calibrate-from-runs.md):\n"
                  "  ndtrain calibrate --from-run RUN_DIR [RUN_DIR ...] [--gpu NAME] [--profile BASE] [--out PATH]")
            print("\nAdd the link between nodes to a CPU profile (under torchrun on every node):\n"
                  "  ndtrain calibrate --links [--out PATH] [--quick]")
            print("\nCPU options (this-machine):")
        forwarded = rest + (["--out", args.out] if args.out else []) + (["--quick"] if args.quick else [])
        return cpu_main(forwarded + (["--help"] if args.help else []))
    if rest:
        raise NdtrainError(f"unknown option(s) for the GPU calibration: {' '.join(rest)}")
    from ndtrain.calibrate import gpu
    from ndtrain.calibrate.cpu import fit_alpha_beta
    from ndtrain.planner.profile_fit import fit_profile

    start = time.perf_counter()
    hw, measured = gpu.calibrate_gpu(args.quick)
    prof = fit_profile(hw, measured, fit_alpha_beta)
    prof["seconds"] = time.perf_counter() - start
    out = Path(args.out or gpu.DEFAULT_GPU_PROFILE).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    print(f"wrote {out} ({prof['seconds']:.0f} s): {prof['device_name']} -> catalog {prof['catalog']}")
    for name, value in sorted(prof["constants"].items()):
        print(f"  {name:<14} {value:.4g}")
    for kind, fit in prof["collectives"].items():
        print(f"  {kind:<14} alpha {fit['alpha'] * 1e6:.1f} us, beta {fit['beta'] / 1e9:.1f} GB/s")
    print(f"plan with it: ndtrain plan --gpu {prof['catalog']} --profile {out} ...")
    return 0


def cpu_main(argv: list[str]) -> int:
    """The CPU calibration of "this-machine": its options, the profile written, a summary printed."""
    from ndtrain.calibrate.cpu import calibrate

    p = argparse.ArgumentParser(prog="ndtrain calibrate", description=CPU_DESCRIPTION)
    p.add_argument("--out", default=str(DEFAULT_PROFILE), help=f"profile path (default {DEFAULT_PROFILE})")
    p.add_argument("--worlds", default="2,4,8", help="process counts for the collectives")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a few seconds)")
    args = p.parse_args(argv)
    try:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    except ValueError as exc:
        raise NdtrainError(f"--worlds must be a comma list of integers, got {args.worlds!r}") from exc
    if any(not 2 <= w <= 64 for w in worlds):
        raise NdtrainError(f"--worlds: each world needs 2 to 64 processes, got {args.worlds!r}")
    out = Path(args.out).expanduser()
    check_output_file(out, "--out")  # before minutes of measuring, not after
    if args.quick:
        prof = calibrate(worlds, sizes=(1 << 12, 1 << 18), reps=3, matmul_sizes=(128, 256), min_time=0.05,
                         attention_seqs=(256,), overhead_reps=3, tp_degrees=(2,))
    else:
        prof = calibrate(worlds)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")  # a reader never sees half a profile
    tmp.write_text(json.dumps(prof, indent=1))
    os.replace(tmp, out)
    print(f"wrote {out} ({prof['seconds']:.1f} s)")
    from ndtrain.planner.hardware import host_probe
    from ndtrain.planner.host_cache import summary

    print("  " + summary(host_probe()))
    for name, flops in prof["matmul"].items():
        print(f"  matmul {name:<12} {flops / 1e9:8.1f} GFLOP/s")
    print(f"  copy bandwidth        {prof['memory']['copy_bw'] / 1e9:8.2f} GB/s")
    print(f"  eager op overhead     {prof['op_overhead_s'] * 1e6:8.1f} us")
    for dtype, rates in prof["attention"].items():
        print(f"  attention {dtype:<5}       " + ", ".join(f"seq {s} {r / 1e9:.1f}" for s, r in rates.items()) + " GFLOP/s")
    print(f"  grad norm + AdamW     {prof['optimizer_s_per_param'] * 1e9:8.2f} ns per parameter")
    print(f"  training GEMMs        {prof['mm_eff']:8.2f} of the square-matmul rate (mm_eff; bf16 layer: "
          f"{prof.get('mm_eff_bf16', prof['mm_eff']):.2f})")
    host = prof["host_s"]
    print(f"  host per micro-batch  {host['layer'] * 1e3:8.2f} ms per layer + {host['head'] * 1e3:.2f} ms (one process)")
    for world, by_tp in prof["tp_host"].items():
        for t, fit in by_tp.items():
            print(f"  TP(+SP) tp={t}, world {world}: per layer {fit['layer']['alpha'] * 1e3:.2f} ms + "
                  f"{fit['layer']['per_byte'] * 1e9:.2f} ns/byte, per micro-batch {fit['head']['alpha'] * 1e3:.2f} ms"
                  f" + {fit['head']['per_byte'] * 1e9:.2f} ns/byte (bytes: one activation)")
    for world, fits in prof["dp_in_situ"].items():
        print(f"  FSDP/DDP in situ, world {world}: " + ", ".join(
            f"{k} alpha {f['alpha'] * 1e6:.0f} us beta {f['beta'] / 1e9:.2f} GB/s" for k, f in fits.items() if k != "measured"))
    for kind, fit in prof["collectives"].items():
        print(f"  {kind:<14} alpha {fit['alpha'] * 1e6:8.1f} us   beta {fit['beta'] / 1e9:6.2f} GB/s   " + "   ".join(
            f"w{w}: {f['alpha'] * 1e6:.0f} us {f['beta'] / 1e9:.2f} GB/s" for w, f in fit["by_world"].items()))
    return 0


def links_main(argv: list[str]) -> int:
    """`ndtrain calibrate --links`: the options; calibrate/links.py measures and writes."""
    from ndtrain.calibrate.links import calibrate_links

    p = argparse.ArgumentParser(prog="ndtrain calibrate --links", description=LINKS_DESCRIPTION)
    p.add_argument("--links", action="store_true", required=True)
    p.add_argument("--out", default=str(DEFAULT_PROFILE), help=f"the profile to add to (default {DEFAULT_PROFILE})")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="CPU ranks only")
    args = p.parse_args(argv)
    return calibrate_links(Path(args.out).expanduser(), args.quick)
