"""Hardware catalog: the GPUs by name (vendor datasheet values, dense, no sparsity), the measured
"this machine", and `get_hardware`, which looks either up. The value itself, what one accelerator
and its links can do, is planner/accelerator.py's `Hardware`.

"this-machine" (CPU ranks, calibrated by `ndtrain calibrate`) keeps its own two fitted numbers,
`mm_eff` and `kappa`, and measured collective fits.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.planner import host_cache, links
from ndtrain.planner.accelerator import A100_KAPPA, NIC_EFF, NVLINK_EFF, GiB, Hardware

# The collectives a profile holds an alpha-beta fit for, CPU and GPU alike.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# A cold torch.compile of one decoder block's forward and backward on a GPU host. An estimate, not
# measured here (no GPU): vLLM reports 19-67 s to compile whole Llama 3 models' forward (1B and
# 8B, H100 and L4; the dynamo trace ~5 s, inductor and Triton the rest); a training block adds its
# backward graph. benchmarks/gpu_check.sh measures it (the train-eager/train-compiled warm-up).
GPU_COMPILE_S = 60.0


def _gpu(name, desc, bf16, fp8, hbm_gib, hbm_tbs, nvlink_gbs, nic_gbs, tdp, generation, sms, **kw) -> Hardware:
    tile = (128, 128) if generation == "ampere" else (128, 256)  # CUTLASS/cuBLAS bf16 main tiles
    return Hardware(name=name, description=desc, peak_bf16=bf16 * 1e12, peak_fp8=fp8 * 1e12,
                    hbm_bytes=hbm_gib * GiB, hbm_bw=hbm_tbs * 1e12, nvlink_bw=nvlink_gbs * 1e9,
                    nic_bw=nic_gbs * 1e9, gpus_per_node=8, tdp_w=tdp, generation=generation, sms=sms, tile=tile,
                    compile_s=GPU_COMPILE_S, **kw)


CATALOG: dict[str, Hardware] = {
    h.name: h
    for h in [
        # A100: 312 TFLOP/s bf16, NVLink3 600 GB/s, HDR InfiniBand 200 Gb/s = 25 GB/s per GPU.
        _gpu("a100-40", "NVIDIA A100 SXM 40GB, HDR IB", 312, 0, 40, 1.555, 600, 25, 400, "ampere", 108),
        _gpu("a100-80", "NVIDIA A100 SXM 80GB, HDR IB", 312, 0, 80, 2.039, 600, 25, 400, "ampere", 108),
        # H100 SXM: ~989 TFLOP/s bf16, NVLink4 900 GB/s, NDR 400 Gb/s = 50 GB/s per GPU.
        _gpu("h100", "NVIDIA H100 SXM 80GB, NDR IB", 989, 1979, 79.6, 3.35, 900, 50, 700, "hopper", 132),
        # The 96 GB HBM2e H100 (Meta's fleet in the torchtitan paper, Liang et al. 2024, 4.1):
        # H100 SXM compute and links, 2.4 TB/s HBM2e; often held below 700 W (`--power-limit`).
        _gpu("h100-96", "NVIDIA H100 SXM 96GB HBM2e, NDR IB", 989, 1979, 95.5, 2.4, 900, 50, 700, "hopper", 132),
        _gpu("h200", "NVIDIA H200 SXM 141GB, NDR IB", 989, 1979, 140.4, 4.8, 900, 50, 700, "hopper", 132),
        # B200 (HGX): 2.25 PFLOP/s dense bf16, NVLink5 1.8 TB/s, ConnectX-7 400 Gb/s.
        _gpu("b200", "NVIDIA B200 180GB, NDR IB", 2250, 4500, 179, 8.0, 1800, 50, 1000, "blackwell", 148),
        # H800: H100 compute with NVLink cut to 400 GB/s (DeepSeek-V3 reports 160 GB/s achieved,
        # i.e. 80% of one direction) and 8 x 400 Gb/s IB.
        _gpu("h800", "NVIDIA H800 SXM 80GB, NDR IB", 989, 1979, 79.6, 3.35, 400, 50, 700, "hopper", 132),
        # The PCIe-slot cards (NVIDIA H100 and H200 NVL datasheets, dense = half the sparsity
        # figures): H100 PCIe 1,513 / 3,026 TFLOP/s sparse bf16 / fp8, 80 GB HBM2e at 2.0 TB/s,
        # 350 W, 114 SMs; H100 NVL 1,671 / 3,341, 94 GB HBM3 at 3.9 TB/s, 400 W, 132 SMs; H200 NVL
        # 1,671 / 3,341, 141 GB HBM3e at 4.8 TB/s, up to 600 W. Their NVLink bridges join pairs
        # (H200 NVL: up to 4) only, so collectives over a node's 8 GPUs run over PCIe Gen5 x16:
        # 128 GB/s both directions. Scale-out as the SXM entries (`ndtrain plan --network`).
        _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB, NDR IB", 756, 1513, 79.6, 2.0, 128, 50, 350, "hopper", 114),
        _gpu("h100-nvl", "NVIDIA H100 NVL 94GB, NDR IB", 835, 1671, 93.6, 3.9, 128, 50, 400, "hopper", 132),
        _gpu("h200-nvl", "NVIDIA H200 NVL 141GB, NDR IB", 835, 1671, 140.4, 4.8, 128, 50, 600, "hopper", 132),
    ]
}
ALIASES = {"a100": "a100-80", "h100-sxm": "h100", "h100-96gb": "h100-96", "h100sxm": "h100", "a100-80gb": "a100-80",
           "a100-40gb": "a100-40", "h100pcie": "h100-pcie", "h100nvl": "h100-nvl", "h200nvl": "h200-nvl",
           "local": "this-machine", "cpu": "this-machine"}

# CUDA device names (torch.cuda.get_device_name, upper-cased) -> catalog entries, most specific
# first; the planner and the trainer's MFU both read the catalog through catalog_name. A name
# absent here (an L40S, an H20) is not in the catalog: MFU then measures its peak on the GPU.
DEVICE_NAMES = (("H800 PCIE", "h100-pcie"),  # the export H100 PCIe: the same compute and memory
                ("H800", "h800"), ("H200 NVL", "h200-nvl"), ("H200", "h200"),  # GH200 too
                ("H100 NVL", "h100-nvl"), ("H100 PCIE", "h100-pcie"), ("H100 80GB HBM2E", "h100-pcie"),
                ("H100", "h100"), ("B200", "b200"), ("A100", "a100"))


def catalog_name(device_name: str, memory_bytes: float | None = None) -> str | None:
    """The catalog entry of a CUDA device, e.g. 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H100
    PCIe' -> 'h100-pcie'. Where the name leaves the variant open, the memory decides: an A100 is
    the 80 GB entry unless its name or memory says 40 GB; an H100 with ~94 GB and no 'SXM' in its
    name is the NVL card. None for a device not in the catalog."""
    upper = " ".join(device_name.upper().split())
    for key, name in DEVICE_NAMES:
        if key not in upper:
            continue
        if name == "a100":
            small = "40GB" in upper.replace(" ", "") or (memory_bytes is not None and memory_bytes < 60 * GiB)
            return "a100-40" if small else "a100-80"
        if name == "h100" and "SXM" not in upper and memory_bytes is not None and memory_bytes > 85 * GiB:
            return "h100-nvl"
        return name
    return None


DEFAULT_PROFILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ndtrain" / "hardware.json"


def probe_dir() -> Path:
    """The host probe's cache: beside the calibration profile (read per call: tests move both)."""
    return Path(DEFAULT_PROFILE).parent


def host_probe() -> dict | None:  # this host's cached probe (planner/host_cache.py); None: never ran
    return host_cache.cached_probe(probe_dir())


def this_machine(profile: str | os.PathLike | None = None) -> Hardware:
    """The calibrated local machine (one "device" = one single-threaded process, as the trainer
    runs on CPU). Uncalibrated: the host probe's rates (MFU's too), else conservative defaults."""
    path, data = Path(profile) if profile else DEFAULT_PROFILE, {}
    if not profile and not path.exists() and (probe := host_probe()) is not None:
        return from_profile(host_cache.as_profile(probe), "host probe")
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise NdtrainError(f"cannot read hardware profile {path}: {exc}") from exc
    elif profile:
        raise NdtrainError(f"hardware profile {path} does not exist (run `ndtrain calibrate --out {path}`)")
    if data.get("kind") == "gpu":
        raise NdtrainError(f"profile {path} was measured on a GPU ({data.get('catalog')}): plan with "
                           f"--gpu {data.get('catalog')} --profile {path}")
    return from_profile(data, str(path) if data else "defaults")


# What a tensor-parallel micro-batch costs CPU ranks beyond their share of compute (DTensor
# dispatch of every op, Gloo collectives of activations), where `ndtrain calibrate` measured
# nothing: the figures it measured on the 2-core host of docs/results/benchmarks.md (world 2, tp 2,
# 2026-11-30). Without them the planner priced TP as bare all-reduces and chose tp=2 for the
# peers' model in bf16, which trained at ~0.7x DDP's speed there.
UNMEASURED_TP_HOST = {"2": {"2": {"layer": {"alpha": 18.7e-3, "per_byte": 17.7e-9},
                                  "head": {"alpha": 16.4e-3, "per_byte": 12.2e-9}}}}


# `ndtrain calibrate` does not measure pipelines yet: the figure fitted on the 2-core host of
# docs/results/benchmarks.md (peers' model, world 2, pp 2, 4 micro-batches: 1F1B, Interleaved1F1B v=3 and
# InterleavedZeroBubble v=3 took 0.742, 0.724 and 0.746 s/step where the model without this term
# said 0.753, 0.655 and 0.630: the extra actions of the interleaved and split-backward
# schedules cost ~4 ms each, and without it the planner chose pp=2 over a faster DDP).
UNMEASURED_PP_ACTION_S = 4e-3

# Where calibration did not time torch's DDP reducer (fp32 plain replication: bucketed all-reduces
# on Gloo's thread behind the backward), the share of FSDP2's blocking all-reduce it leaves exposed,
# as fitted in situ on the 2-core host of docs/results/benchmarks.md (2026-11-30, world 2: alpha 0.21 vs
# 1.08 ms, 0.89 vs 0.46 GB/s). Pricing it as the blocking all-reduce ranked ZeRO-1 (one all-to-all
# reduce-scatter and one all-gather) above DDP, which trained 11% faster there (run I).
UNMEASURED_DDP_EXPOSED = {"alpha": 0.195, "beta": 1.95}

# `ndtrain calibrate` does not compile: what compiled blocks measured on the 2-core host of
# docs/results/benchmarks.md (benchmarks/step_options.py, the peers' model, one thread, fresh inductor
# cache; 2026-11-30 and 2026-12-01): a cold compile of 15.4-17.7 s (fp32) and 18.0-27.8 s
# (bf16), and 8.9% (fp32, against the eager oneDNN linears) and 13.5-15.0% (bf16) of the model's
# forward + backward saved, of which the blocks are ~92%: so ~10% and ~14% of a layer. Applied only to a
# calibrated profile: on the uncalibrated defaults the saving is not priced and compile stays off.
# A profile's own `compile_s` and `compile_saving` (fitted from compiled runs) replace them; one
# whose `unmeasured` names compile (fitted to runs that did not compile) prices no compile at all.
UNMEASURED_CPU_COMPILE = {"compile_s": 18.0, "saving": {"fp32": 0.10, "bf16": 0.14}}


def _ddp_reducer_fit(blocking: dict) -> dict:
    return {"alpha": blocking["alpha"] * UNMEASURED_DDP_EXPOSED["alpha"],
            "beta": blocking["beta"] * UNMEASURED_DDP_EXPOSED["beta"]}


def from_profile(data: dict, source: str = "") -> Hardware:
    """The "this-machine" entry from a calibration profile (a dict as `ndtrain calibrate` writes)."""
    matmul = data.get("matmul", {})
    mem = data.get("memory", {})
    colls = data.get("collectives", {})
    # Where neither calibration nor the host probe measured: a few GFLOP/s per core and a slow
    # loopback, chosen to under-promise. The probe alone (host_cache.as_profile) measures compute only.
    fp32, probe_only = matmul.get("fp32_1thread", 20e9), bool(data.get("host_probe"))
    bf16, calibrated = matmul.get("bf16_1thread", fp32 / 4), bool(data) and not probe_only
    # A Gloo collective inside training (cores busy with compute, FSDP's copies in and out) reached
    # 0.24-0.33 GB/s on the 2-core host of docs/results/benchmarks.md, against 0.6-1.35 GB/s in an idle
    # loop: the default is the in-situ figure, as pessimistic as the compute default.
    default_fit = {"alpha": 100e-6, "beta": 0.3e9}
    fits = {name: {k: colls[name][k] for k in ("alpha", "beta")} if name in colls else default_fit
            for name in COLLECTIVES}
    if "reduce_scatter" not in colls:
        # The runtime's reduce-scatter on Gloo is an all-to-all and a local sum
        # (parallel/gloo_reduce_scatter.py; Gloo's own runs a full all-reduce): unmeasured, it costs
        # the all-to-all of its input, the same (k-1) alpha + (k-1)/k n / beta in comm.py's terms.
        fits["reduce_scatter"] = dict(fits["all_to_all"])
    by_world: dict = {}
    for name in COLLECTIVES:
        for world, fit in colls.get(name, {}).get("by_world", {}).items():
            by_world.setdefault(str(world), {})[name] = {"alpha": fit["alpha"], "beta": fit["beta"]}
    # Where the runtime's FSDP/DDP were timed in situ, their collectives cost what training saw
    # (cold buffers, copies, a Gloo thread sharing the core with compute), not what an idle loop does.
    for world, in_situ in data.get("dp_in_situ", {}).items():
        for name, fit in in_situ.items():
            if name.removesuffix("_tp").removesuffix("_ddp") in COLLECTIVES:
                by_world.setdefault(str(world), {})[name] = {"alpha": fit["alpha"], "beta": fit["beta"]}
    if not any("all_reduce_ddp" in w for w in by_world.values()):
        fits["all_reduce_ddp"] = _ddp_reducer_fit(fits["all_reduce"])
        for in_world in by_world.values():
            if "all_reduce" in in_world:
                in_world["all_reduce_ddp"] = _ddp_reducer_fit(in_world["all_reduce"])
    attn = data.get("attention", {})
    compile_why = str(data.get("unmeasured", {}).get("compile", ""))
    compile_priced = not compile_why and (calibrated or {"compile_s", "compile_saving"} <= set(data))
    return _with_links(Hardware(
        name="this-machine",
        description=data.get("description", "this machine (uncalibrated: host probe)" if probe_only else
                             "this machine (uncalibrated defaults)" if not data else "this machine"),
        peak_bf16=bf16, peak_fp8=0.0, peak_fp32=fp32,
        hbm_bytes=mem.get("bytes_per_device", mem.get("total_bytes", 8 * GiB) / 4),
        hbm_bw=mem.get("copy_bw", 5e9), nvlink_bw=2 * fits["all_gather"]["beta"] / NVLINK_EFF,
        nic_bw=fits["all_gather"]["beta"] / NIC_EFF, gpus_per_node=int(data.get("devices_per_node", 4)),
        tdp_w=float(data.get("watts_per_device", 15.0)),
        # mm_eff: what a plain decoder layer measured at calibration says GEMMs of training shapes
        # reach of the square-matmul rate (1 where not measured).
        mm_eff=float(data.get("mm_eff", 1.0)), mm_eff_bf16=float(data.get("mm_eff_bf16", 0.0)),
        # the runtime's own memory beside the model (Python, torch): fitted by `calibrate --from-run`
        kappa=A100_KAPPA, overhead_bytes=float(data.get("overhead_gib", 0.3)) * GiB,
        op_overhead_s=data.get("op_overhead_s", 30e-6), alpha_intra=fits["all_gather"]["alpha"],
        alpha_inter=fits["all_gather"]["alpha"], collectives=fits, source=source,
        cores=int(data.get("cores") or os.cpu_count() or 1),
        attn_flops={k: {str(n): float(r) for n, r in attn[k].items()} for k in ("fp32", "bf16") if attn.get(k)},
        layer_overhead_s=float(data.get("host_s", {}).get("layer", 0.0)),
        head_overhead_s=float(data.get("host_s", {}).get("head", 0.0)),
        tp_host={str(w): {str(t): {k: {f: float(v[k][f]) for f in ("alpha", "per_byte")} for k in ("layer", "head")}
                          for t, v in by_tp.items()} for w, by_tp in data.get("tp_host", UNMEASURED_TP_HOST).items()},
        optimizer_s_per_param=float(data.get("optimizer_s_per_param", 0.0)),
        pp_action_s=float(data.get("pp_action_s", UNMEASURED_PP_ACTION_S)),
        collectives_by_world=by_world,
        compile_s=float(data.get("compile_s", UNMEASURED_CPU_COMPILE["compile_s"])) if compile_priced else 0.0,
        cpu_compile_saving=dict(data.get("compile_saving", UNMEASURED_CPU_COMPILE["saving"])) if compile_priced else {},
        compile_unmeasured=compile_why, calibrated=calibrated,
    ), links.fields(data))


def _with_links(hw: Hardware, measured: dict) -> Hardware:
    """Measured across nodes (planner/links.py): groups that cross nodes are priced on the node's
    link, each of its ranks_per_node ranks getting its share (inter_bw multiplies NIC_EFF back)."""
    if not measured:
        return hw
    q = measured["ranks_per_node"]
    intra = {"alpha_intra": measured["alpha_intra"]} if "alpha_intra" in measured else {}
    across = {kind: {"alpha": a, "beta": b / q} for kind, (a, b) in measured.get("collectives", {}).items()}
    return dataclasses.replace(hw, gpus_per_node=q, alpha_inter=measured["alpha_inter"],
                               nic_bw=measured["beta_inter"] / q / NIC_EFF, inter_collectives=across, **intra)


def get_hardware(name: str | Hardware, profile: str | None = None) -> Hardware:
    if isinstance(name, Hardware):
        return name
    key = ALIASES.get(name.lower(), name.lower())
    if key == "this-machine":
        return this_machine(profile)
    if key not in CATALOG:
        raise NdtrainError(f"unknown hardware {name!r}; choose one of {', '.join([*CATALOG, 'this-machine'])}")
    if profile:  # a GPU calibration profile applies through planner/profile.py's hardware_for
        raise NdtrainError(f"a GPU profile ({profile}) is applied by ndtrain.planner.profile.hardware_for")
    return CATALOG[key]


def with_constants(hw: Hardware, **changes) -> Hardware:
    return dataclasses.replace(hw, **changes)
