"""The host probe's cache and what its rates decide. Torch-free: the planner reads the cached
probe as it reads a calibration profile, and calibrate/host_probe.py (which runs torch) measures it.

One probe per host: the file name is a hash of what makes two hosts' kernels differ (the CPU
model and its matmul ISA flags, the cores, the torch build, the ISA caps oneDNN and MKL read from
the environment) and of the probe's thread count, so a different CPU or torch probes again and a
home directory shared between hosts keeps one file per host. It sits beside the calibration
profile (~/.cache/ndtrain/), and `ndtrain calibrate` refreshes it.

The decisions are functions of the measured rates only, so every rank reading the same file
decides the same, and the unit tests give them rates instead of measuring.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

PROBE_VERSION = 2  # bump when what the probe measures changes: older files are then re-probed
PROBE_THREADS = 1  # the probe runs single-threaded, as each CPU rank does (OMP_NUM_THREADS=1)
# The flags that change which matmul kernel oneDNN and MKL dispatch to (AMX-BF16: ~10x fp32).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
             "amx_fp16")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dot products in hardware, not converted to fp32
# oneDNN only where it measured this much faster than the BLAS: the forward gain it was chosen for
# on the AMD host was 7%, and a smaller margin would let the noise of a shared host pick.
ONEDNN_MARGIN = 1.03
# bf16 attends in bf16 only where that measured this much faster than attending in fp32 (the more
# exact path, and the one bf16 runs took before the probe): the same guard against noise.
BF16_ATTENTION_MARGIN = 1.03
ATTENTION_HEAD_DIMS = (32, 128)  # the probe's; a model takes the choice of the nearest (in log)
PLANNER_HEAD_DIM = 32  # the attention rate the planner prices: the small models CPU ranks train
# fp8 is "emulated" where one small _scaled_mm reaches under 1% of bf16's rate at the same shape
# (0.03 vs ~1,000 GFLOP/s on the AMX host: 0.003%); an fp8 run there is orders of magnitude slower.
FP8_EMULATED_BELOW = 0.01


# What the planner and the runtime read from a probe (host_probe.py measures these and more)
REQUIRED_RATES = ("fp32", "bf16", "fp32_blas", "fp32_onednn", "block_bf16_speedup",
                  *(f"attn_{k}_d{d}" for k in ("fp32", "bf16_native", "bf16_in_fp32") for d in ATTENTION_HEAD_DIMS))


def _cpuinfo(text: str | None = None) -> tuple[str, set[str]]:
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: the model name alone keys the host
            import platform

            return platform.processor() or platform.machine(), set()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (model.group(1).strip() if model else "unknown"), set(flags.group(1).split() if flags else ())


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:  # the installed distribution's version, without importing torch (the planner is torch-free)
        return version("torch")
    except PackageNotFoundError:
        return "none"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def host_key(cpuinfo: str | None = None, torch_version: str | None = None, env=None, cores: int | None = None) -> dict:
    """What identifies this host's kernels; the probe's file is named by its hash."""
    model, flags = _cpuinfo(cpuinfo)
    env = os.environ if env is None else env
    return {"version": PROBE_VERSION, "cpu": model, "flags": sorted(f for f in ISA_FLAGS if f in flags),
            "cores": cores or _cores(), "torch": torch_version or _torch_version(), "threads": PROBE_THREADS,
            "env": {k: env[k] for k in ISA_ENV if env.get(k)}}


def cache_path(key: dict, directory: Path) -> Path:
    """`directory`: the calibration profile's (planner/hardware.py's probe_dir)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"host-probe-{digest}.json"


def cached_probe(directory: Path, key: dict | None = None) -> dict | None:
    """This host's cached probe, or None (never probed, another host's or an older probe's file,
    or unreadable: a cache is never an error, the probe runs again)."""
    key = key or host_key()
    try:
        data = json.loads(cache_path(key, directory).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and data.get("key") == key and isinstance(data.get("decisions"), dict)
            and isinstance(data.get("rates"), dict) and all(k in data["rates"] for k in REQUIRED_RATES)):
        return None  # another host's, or a file this probe did not write whole: probe again
    return data


def write(data: dict, directory: Path) -> Path:
    """Atomically: concurrent ranks or runs may write the same file, and a reader never sees half."""
    path = cache_path(data["key"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def decide(rates: dict, flags=()) -> dict:
    """The host's defaults from the probe's rates (FLOP/s; see calibrate/host_probe.py for the keys):
    cpu_matmul: "onednn" only where its fp32 linears measured ONEDNN_MARGIN faster than the BLAS;
    bf16_attention: the dtype a bf16 run's CPU attention runs in, whichever measured faster;
    fp8_ratio: fp8 _scaled_mm over bf16 at the same small shape, fp8_emulated below 1%;
    native_bf16: the CPU has bf16 dot products (the precision choice needs them)."""
    onednn = rates["fp32_onednn"] >= ONEDNN_MARGIN * rates["fp32_blas"]
    attention = {str(d): "bf16" if rates[f"attn_bf16_native_d{d}"] >= BF16_ATTENTION_MARGIN
                 * rates[f"attn_bf16_in_fp32_d{d}"] else "fp32" for d in ATTENTION_HEAD_DIMS}
    ratio = rates.get("fp8_small", 0.0) / rates["bf16_small"] if rates.get("bf16_small") else 0.0
    return {"cpu_matmul": "onednn" if onednn else "blas", "bf16_attention": attention, "fp8_ratio": ratio,
            "fp8_emulated": ratio < FP8_EMULATED_BELOW,
            "native_bf16": any(f in flags for f in NATIVE_BF16_FLAGS) and rates["bf16"] > rates["fp32"]}


def bf16_attention(decisions: dict, head_dim: int) -> str:
    """The dtype a bf16 model of this head dim attends in on this host: the probed head dim
    nearest to it decides."""
    import math

    nearest = min(ATTENTION_HEAD_DIMS, key=lambda d: abs(math.log(d / max(head_dim, 1))))
    return decisions["bf16_attention"][str(nearest)]


def as_profile(probe: dict) -> dict:
    """The probe as the fields of a calibration profile that planner/hardware.py's from_profile
    reads: one thread's matmul rate per precision (the chosen kernel's) and the attention rate
    at the probed sequence length (bf16: the dtype it will attend in)."""
    rates, chosen = probe["rates"], probe["decisions"]
    seq, d = str(probe["attention_seq"]), PLANNER_HEAD_DIM
    native = bf16_attention(chosen, d) == "bf16"
    bf16_attn = rates[f"attn_bf16_native_d{d}" if native else f"attn_bf16_in_fp32_d{d}"]
    # bf16's GEMMs reach what a whole bf16 decoder block measured over fp32 (the matmul rates'
    # ratio overstates it: norms, RoPE and casts stay fp32), the role calibration's fitted
    # mm_eff_bf16 plays; the peak stays the matmul's, as MFU divides by it.
    matmul_speedup = rates["bf16"] / rates["fp32"]
    eff = min(1.0, rates["block_bf16_speedup"] / matmul_speedup) if "block_bf16_speedup" in rates else 0.0
    return {"matmul": {"fp32_1thread": rates["fp32"], "bf16_1thread": rates["bf16"]}, "mm_eff_bf16": eff,
            "attention": {"fp32": {seq: rates[f"attn_fp32_d{d}"]}, "bf16": {seq: bf16_attn}},
            "cores": probe["key"]["cores"], "host_probe": True}


def summary(probe: dict) -> str:
    """One line: what the probe measured and chose."""
    r, d = probe["rates"], probe["decisions"]
    g = lambda x: f"{x / 1e9:.3g}"  # noqa: E731
    attn = "; ".join(f"head_dim {h}: fp32 {g(r[f'attn_fp32_d{h}'])}, bf16 {g(r[f'attn_bf16_native_d{h}'])}, "
                     f"bf16 in fp32 {g(r[f'attn_bf16_in_fp32_d{h}'])}" for h in ATTENTION_HEAD_DIMS)
    return (f"host probe ({probe['key']['cpu']}, 1 thread, GFLOP/s): matmul fp32 {g(r['fp32'])} (BLAS "
            f"{g(r['fp32_blas'])}, oneDNN {g(r['fp32_onednn'])}), bf16 {g(r['bf16'])}, fp8 {g(r.get('fp8_small', 0))} "
            f"({100 * d['fp8_ratio']:.3g}% of bf16 at {probe['small_n']}^3); attention {attn} -> cpu_matmul "
            f"{d['cpu_matmul']}; a bf16 tiny block {r.get('block_bf16_speedup', 0):.2f}x fp32's; bf16 attends in "
            + ", ".join(f"{v} at head_dim {k}" for k, v in d["bf16_attention"].items()))
