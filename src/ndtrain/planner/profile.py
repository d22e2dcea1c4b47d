"""GPU calibration profiles: what `ndtrain calibrate` measured on a GPU, turned into the planner's
constants. Torch-free: the measuring is src/ndtrain/calibrate/gpu.py's; this module fits
and reads what it wrote, so a profile made on a GPU node plans on a laptop.

A profile (JSON, "kind": "gpu") holds the raw measurements and the constants fitted from them:
  gemm        [m, n, k, "bf16"|"fp8", seconds] samples -> gemm_eff, gemm_k0, fp8_gemm_eff: the
              GEMM model of planner/gemm.py fitted by least squares on log time
  attention   [batch, heads, seq, head_dim, seconds] causal flash forward + backward -> attn_eff
  hbm         copy bandwidth -> hbm_eff (of the catalog's datasheet bandwidth)
  collectives {kind: [world, bytes, seconds] samples} -> alpha-beta fits used inside a node
  memory      bytes outside the allocator (CUDA context, NCCL, cuBLAS) -> overhead_gib; reserved
              over allocated after a training-like allocation pattern -> fragmentation
`ndtrain plan --gpu h100 --profile gpu.json` applies them to the catalog entry the profile names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.planner import constants as consts
from ndtrain.planner.accelerator import Hardware
from ndtrain.planner.hardware import ALIASES, COLLECTIVES, get_hardware

VERSION = 1


def read_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise NdtrainError(f"hardware profile {path} does not exist (run `ndtrain calibrate --out {path}`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise NdtrainError(f"cannot read hardware profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise NdtrainError(f"hardware profile {path} is not a JSON object")
    return data


def is_gpu(data: dict) -> bool:
    return data.get("kind") == "gpu"


def apply(hw: Hardware, data: dict, source: str = "") -> Hardware:
    """The catalog entry `hw` with what a GPU profile measured: its fitted constants (as
    `Hardware.measured`, which problems resolve over the catalog's), its collective fits inside
    a node, and its HBM bandwidth."""
    if not is_gpu(data):
        raise NdtrainError(f"profile {source} is a CPU profile (it plans --gpu this-machine), not a GPU's")
    if data.get("version") != VERSION:
        raise NdtrainError(f"GPU profile {source}: version {data.get('version')!r}, expected {VERSION}")
    if data.get("catalog") not in (None, hw.name):
        raise NdtrainError(f"GPU profile {source} was measured on {data.get('catalog')} ({data.get('device_name', '?')}), "
                           f"not {hw.name}: plan with --gpu {data.get('catalog')}")
    known = set(consts.entries(hw.generation))
    measured = {k: float(v) for k, v in data.get("constants", {}).items() if k in known}
    fits = {kind: {"alpha": float(f["alpha"]), "beta": float(f["beta"])}
            for kind, f in data.get("collectives", {}).items() if kind in COLLECTIVES and "alpha" in f}
    return dataclasses.replace(hw, measured=measured, collectives=fits, source=source or "GPU profile",
                               description=f"{hw.description}; calibrated {data.get('calibrated', '')}".rstrip("; "))


def hardware_for(name: str | Hardware, profile: str | Path | None = None) -> Hardware:
    """`get_hardware`, with a GPU calibration profile's measurements laid over a catalog GPU
    (`plan --gpu h100 --profile gpu.json`); a CPU profile describes `this-machine`."""
    if profile and not isinstance(name, Hardware) and ALIASES.get(name.lower(), name.lower()) != "this-machine":
        hw = get_hardware(name)
        return apply(hw, read_profile(profile), str(profile))
    return get_hardware(name, profile)
