"""Fixtures shared by every test package (a small real corpus, the parity-test base config, the
fp8 matmul speed) and the per-file time budget report printed at the end of a run."""

from __future__ import annotations

import os
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every run a test starts, in this process or as a rank of `ndtrain train --nproc`, installs the
# test-only fault plan (tests/train/fault_plan.py: it does nothing while NDTRAIN_FAULTS is unset)
# through the job's hook (src/ndtrain/train/hooks.py).
_FAULT_PLAN_DIR = str(Path(__file__).parent / "train")
if _FAULT_PLAN_DIR not in sys.path:
    sys.path.insert(0, _FAULT_PLAN_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_FAULT_PLAN_DIR, os.environ.get("PYTHONPATH", "")]))
os.environ.setdefault("NDTRAIN_JOB_HOOKS", "fault_plan:hooks")


def _reference_host_cache() -> Path:
    """The suite's own cache directory (XDG_CACHE_HOME, inherited by every process a test starts),
    holding a host probe with fixed rates under this host's key: the probe's choices (cpu_matmul,
    bf16's attention dtype, the precision) and the uncalibrated planner's rates are then the same
    on every host and in every test order, instead of this machine's ~/.cache (a probe cached
    by whichever earlier run made it, or a calibration profile). The rates are a reference
    host's, the AMD EPYC's of docs/results/benchmarks.md: oneDNN 1.15x the BLAS, bf16 attention slower
    than attending in fp32, a bf16 block 1.4x an fp32 one, fp8 ~15% of bf16. Tests of the probe
    itself (tests/tools/test_host_probe.py) move the cache again, to directories of their own."""
    import tempfile

    from ndtrain.planner import host_cache

    root = Path(tempfile.mkdtemp(prefix="ndtrain-test-cache-"))
    os.environ["XDG_CACHE_HOME"] = str(root)
    rates = {"fp32_blas": 60e9, "fp32_onednn": 69e9, "fp32": 69e9, "bf16": 150e9, "bf16_small": 130e9,
             "fp8_small": 20e9, "block_bf16_speedup": 1.4}
    for d in host_cache.ATTENTION_HEAD_DIMS:
        rates.update({f"attn_fp32_d{d}": 15e9, f"attn_bf16_in_fp32_d{d}": 16e9, f"attn_bf16_native_d{d}": 12.8e9})
    key = host_cache.host_key()
    host_cache.write({"key": key, "rates": rates, "decisions": host_cache.decide(rates, key["flags"]),
                      "small_n": 128, "attention_seq": 256, "reference": "tests/conftest.py"}, root / "ndtrain")
    return root


if not os.environ.get("NDTRAIN_TEST_REAL_CACHE"):  # =1: the suite on this host's own probe and profile
    import atexit
    import shutil

    REFERENCE_CACHE = _reference_host_cache()  # before any test imports ndtrain's hardware module
    atexit.register(shutil.rmtree, REFERENCE_CACHE, True)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """~400 KB of the Python standard library, byte-tokenized: real text, prepared once."""
    from ndtrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("corpus") / "stdlib-byte"
    prepare(None, out, tokenizer="byte", val_fraction=0.05, max_bytes=400_000)
    return out


@pytest.fixture(scope="session")
def parity_base(corpus_dir):
    """Config overrides (a dict of sections) for layout parity: debug model, 8 sequences of 64.

    AdamW's first steps move each weight by ~lr * g/(|g| + eps); for gradients that are sums
    with heavy cancellation, reduction-order noise flips that ratio. eps=1e-6 and lr=1e-3 bound
    the effect of a ~1e-9 gradient difference to ~1e-6, so 1e-5 is a real fp32 tolerance."""
    return {
        "model": {"preset": "debug"},
        "data": {"path": str(corpus_dir), "seq_len": 64},
        "optimizer": {"lr": 1e-3, "eps": 1e-6, "warmup_steps": 0, "schedule": "constant"},
        "train": {"global_batch": 8, "micro_batch": 8, "seed": 1234},
        "logging": {"tensorboard": False, "progress": "off"},
    }


# ---- fp8 matmul speed: where torch._scaled_mm is emulated, the fp8 tests shrink ----------------

FP8_FORCE_ENV = "NDTRAIN_TEST_FP8"  # "slow" or "fast": skip the probe (CI, or this host imitating the other kind)


@dataclass(frozen=True)
class Fp8Speed:
    """One timed 128^3 `torch._scaled_mm` against a bf16 matmul of the same shape.

    `slow` where fp8 reaches under 1% of bf16's rate (the issue's own line for "emulated": the
    Sapphire Rapids host ran 0.03 GFLOP/s against 1,452) or under 1 GFLOP/s: the full-size
    default fp8 curve tests multiply ~15 GFLOP in fp8 (4 layers x 7 Linears x 3 GEMMs x 512
    tokens, 12 steps, world 1 and FSDP 2), i.e. ~15 s at 1 GFLOP/s, the most their budget
    allows; at 0.03 GFLOP/s they would take ~8 minutes."""

    fp8_gflops: float
    bf16_gflops: float
    forced: str = ""

    @property
    def slow(self) -> bool:
        if self.forced:
            return self.forced == "slow"
        return self.fp8_gflops < max(0.01 * self.bf16_gflops, 1.0)

    def describe(self) -> str:
        if self.forced:
            return f"fp8 matmul forced {self.forced} ({FP8_FORCE_ENV})"
        kind = "slow" if self.slow else "fast"
        return f"fp8 matmul {self.fp8_gflops:.3g} GFLOP/s vs bf16 {self.bf16_gflops:.3g} ({kind})"


def probe_fp8_speed(n: int = 128) -> Fp8Speed:
    import torch

    forced = os.environ.get(FP8_FORCE_ENV, "")
    if forced:
        if forced not in ("slow", "fast"):
            raise pytest.UsageError(f"{FP8_FORCE_ENV} must be 'slow' or 'fast', got {forced!r}")
        return Fp8Speed(0.0, 0.0, forced)
    a = torch.randn(n, n).to(torch.float8_e4m3fn)
    b = torch.randn(n, n).to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
    one = torch.ones(())
    x, y = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)

    def rate(fn, reps: int) -> float:
        t0 = time.perf_counter()
        fn()  # the first call pays for kernel selection; if it alone is slow, it is the answer
        best = time.perf_counter() - t0
        for _ in range(reps if best < 0.05 else 0):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e9

    fp8 = rate(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 2)
    return Fp8Speed(fp8, rate(lambda: x @ y, 3))


@pytest.fixture(scope="session")
def fp8_speed() -> Fp8Speed:
    return probe_fp8_speed()


@pytest.fixture
def fp8_cheap_peak(fp8_speed, monkeypatch) -> Fp8Speed:
    """`fp8_speed`; where fp8 is slow, the trainer's fp8 peak probe (calibrate/peak_flops.py: 9 calls of
    a 512^3 `_scaled_mm`, ~80 s at 0.03 GFLOP/s, in every fp8 Trainer) is skipped. There the probe
    yields the bf16 peak anyway (fp8 measures below it), which is what this returns, so only tests
    that do not read MFU use it (test_fp8_mfu_names_both_peaks runs the real probe)."""
    if fp8_speed.slow:
        from ndtrain.train import metrics

        real = metrics.run_peaks

        def bf16_peak_for_fp8(device, dtype, fp8):
            peak, source, _, _ = real(device, dtype, False)
            return peak, source, (peak if fp8 else 0.0), ("the bf16 peak (fp8 emulated here)" if fp8 else "")

        monkeypatch.setattr(metrics, "run_peaks", bf16_peak_for_fp8)  # forked ranks inherit it
    return fp8_speed


# ---- this host's speed: the per-file budgets and every hang guard scale with it ----------------

BUDGETS = Path(__file__).with_name("budgets.toml")
_HOST_SPEED = pytest.StashKey[tuple[float, str]]()


def _host_slowdown(ref: dict) -> tuple[float, str]:
    """How much slower this host is, now, than the host the budgets were set on (never below 1,
    so a faster host keeps the reference budgets). Two quick probes, the median of 5 each: small
    torch ops (dispatch: what the tiny-model tests spend most of their time in) and a 256^3 fp32
    matmul (one thread). A shared, loaded host reads as a slower one, which is what it is."""
    import statistics

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = torch.ones(64, 64)
        a, b = torch.randn(256, 256), torch.randn(256, 256)

        def ops():
            t0 = time.perf_counter()
            for _ in range(2000):
                t.add(1.0)
            return time.perf_counter() - t0

        def mm():
            t0 = time.perf_counter()
            for _ in range(8):
                a @ b
            return time.perf_counter() - t0

        ops(), mm()
        op_us = statistics.median(ops() for _ in range(5)) / 2000 * 1e6
        gflops = 8 * 2 * 256**3 / statistics.median(mm() for _ in range(5)) / 1e9
    finally:
        torch.set_num_threads(threads)
    scale = max(1.0, op_us / ref["op_us"], ref["matmul_gflops"] / gflops)
    return scale, (f"small op {op_us:.1f} us (ref {ref['op_us']}), "
                   f"fp32 matmul {gflops:.0f} GFLOP/s (ref {ref['matmul_gflops']})")


def host_slowdown(config) -> tuple[float, str]:
    """(`_host_slowdown` against budgets.toml's reference host, what it measured): probed once per
    session (per xdist worker, and once in the controller for the report), when first asked."""
    if _HOST_SPEED not in config.stash:
        config.stash[_HOST_SPEED] = _host_slowdown(tomllib.loads(BUDGETS.read_text())["reference"])
    return config.stash[_HOST_SPEED]


# A hang guard stretches with the host's slowdown up to this factor: a guard must still end a truly
# hung test within CI's 90 minutes (pyproject's 300 s default x 6 = 30 min), and the probe of a host
# shared with other work can read x20 for a while (measured here at load 25), which would let a
# hang run for hours.
HANG_SCALE_CAP = 6.0


def hang_scale(config) -> float:
    return min(HANG_SCALE_CAP, host_slowdown(config)[0])


@pytest.fixture(scope="session")
def hang_deadline(pytestconfig):
    """hang_deadline(base_s): the seconds a wait may take before the test calls it hung. `base_s`
    is generous on the reference host (many times what the wait takes there); it is multiplied by
    this host's measured slowdown (host_slowdown, never below 1, so never below base_s): the same
    wait on a host several times slower, or loaded, is not a hang. Only for waits that stop a hung
    test; what a test asserts is counted work or a comparison, never a time."""
    scale = hang_scale(pytestconfig)

    def seconds(base_s: float) -> float:
        return base_s * scale

    return seconds


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Every pytest-timeout limit (a test's marker, pyproject's default) is a hang guard set for the
    reference host: it is multiplied by this host's slowdown, as hang_deadline's waits are, so that
    a test's own limit and the waits inside it keep their order on any host."""
    plugin = item.config.pluginmanager.get_plugin("timeout")
    scaled = settings._replace(timeout=settings.timeout * hang_scale(item.config))
    return plugin.pytest_timeout_set_timer(item=item, settings=scaled)


# ---- per-file time against its budget (tests/budgets.toml), printed at the end of a run ----------

_SESSION_START = time.monotonic()  # conftest import: the start of collection
DEFAULT_SELECTION = "not slow and not heavy"  # pyproject's addopts: what `make test` runs


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist (`make test` runs two workers, one file per worker at a time), the files
    with the largest budgets go first, so the last file to start is a short one and the two
    workers end together (longest-first list scheduling: the makespan is within a third of the
    best possible). Within a file the order is unchanged; without xdist nothing moves."""
    if not getattr(config.option, "numprocesses", None):
        return
    files = tomllib.loads(BUDGETS.read_text())["files"]
    per_test = {}
    for item in items:
        key = item.nodeid.split("::")[0].removeprefix("tests/")
        per_test[key] = per_test.get(key, 0) + 1
    weight = {k: files.get(k, float(n)) for k, n in per_test.items()}  # an unlisted file: ~1 s a test
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0].removeprefix("tests/"), i)
    items.sort(key=lambda it: (-weight[k := it.nodeid.split("::")[0].removeprefix("tests/")], first_seen[k]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Each test file's total time (setup + call + teardown) against its budget; files over it are
    warnings, never failures (time on a shared host is not a property of the code)."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown") and hasattr(r, "duration"):
                path = r.nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + r.duration
    if not per_file:
        return
    table = tomllib.loads(BUDGETS.read_text())
    scale, probe = host_slowdown(config)
    files, default = table["files"], table["default"]
    tw = terminalreporter
    # Budgets are the default suite's (pyproject's addopts); other selections get the table only.
    judge = (config.getoption("markexpr") or "").strip() == DEFAULT_SELECTION
    tw.write_sep("=", f"time per test file against its budget (tests/budgets.toml) x {scale:.2f} for this host")
    tw.write_line(f"host probe: {probe}" + ("" if judge else "; not the default suite, so no file is judged"))
    over = 0
    for path, spent in sorted(per_file.items(), key=lambda kv: -kv[1]):
        key = path.removeprefix("tests/")
        n = sum(1 for reports in tw.stats.values() for r in reports
                if getattr(r, "when", None) == "call" and r.nodeid.startswith(path + "::"))
        budget = scale * (files[key] if key in files else max(default["min_s"], default["per_test_s"] * n))
        late = judge and spent > budget
        over += late
        if late or spent >= 1.0:
            origin = "" if key in files else " (default)"
            tw.write_line(f"{'OVER BUDGET ' if late else ''}{spent:7.1f} s / {budget:6.1f} s{origin}  {path}",
                          yellow=late, bold=late)
    total, suite = sum(per_file.values()), scale * table["suite"]["total_s"]
    tw.write_line(f"{total:7.1f} s / {suite:6.1f} s  all {len(per_file)} file(s) run, summed over workers "
                  "(the budget is the whole default suite's)", yellow=judge and total > suite)
    # The promise itself is wall time and absolute: CI's clock does not scale with its host's speed
    # (an Intel host with 4x this reference's per-op cost took 15m37s for the suite run serially).
    wall, promise = time.monotonic() - _SESSION_START, table["suite"]["total_s"]
    tw.write_line(f"{wall:7.1f} s wall of the {promise:.0f} s promised (unscaled), "
                  f"{getattr(config.option, 'numprocesses', None) or 1} worker(s)",
                  yellow=judge and wall > promise, bold=judge and wall > promise)
    if over:
        tw.write_line(f"{over} file(s) over budget: split them, or move their long tests to heavy (make test-heavy, "
                      "which CI runs) or slow (make test-slow)",
                      yellow=True)
