"""What one accelerator and its links can do: the `Hardware` value the planner prices a layout on.
A catalog GPU (planner/hardware.py's CATALOG) fills it from datasheet values, "this-machine"
(CPU ranks) from a measured profile (planner/hardware.py's `from_profile`).

Bandwidths are in bytes/s: `nvlink_bw` is the bidirectional NVLink figure vendors quote per GPU,
`nic_bw` is the scale-out network per GPU per direction (one NIC per GPU, as on DGX/HGX nodes).

Efficiencies are not datasheet values: for GPUs they live in planner/constants.py, per GPU
generation (`generation` below), with their ranges and sources. The SM count and the GEMM tile
are facts of the chip and its cuBLAS/CUTLASS kernels (wave quantization, planner/gemm.py).

The network as built: `gpus_per_node` GPUs share an NVLink domain; a pod of `pod_gpus` GPUs has
full bisection bandwidth (0: the whole cluster does); above the pod the fabric is oversubscribed
`oversubscription` : 1 (Llama 3's cluster: pods of 3,072 GPUs, 1:7 above, Dubey et al. 2024
section 3.3.1). `ndtrain plan --network` changes these per run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ndtrain.errors import NdtrainError

GiB = 1024**3

# "this-machine" (CPU ranks): mm_eff is fitted at calibration; kappa is the eager-kernel value.
A100_MM_EFF = 0.625
A100_KAPPA = 5.0

# Achieved fraction of the link rate for the calibrated CPU loopback stand-in (its collectives are
# measured fits; these only size the unused link fields). GPUs take theirs from constants.py.
NVLINK_EFF = 0.80
NIC_EFF = 0.90


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_bf16: float  # FLOP/s, dense
    peak_fp8: float  # FLOP/s, dense; 0 = unsupported
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s, bidirectional per GPU
    nic_bw: float  # bytes/s, per direction per GPU
    gpus_per_node: int
    tdp_w: float
    peak_fp32: float = 0.0  # only CPUs train in fp32; 0 = use peak_bf16 / 2
    mm_eff: float = A100_MM_EFF
    # CPU ranks: mm_eff fitted on a bf16 layer (0: not measured, mm_eff serves both)
    mm_eff_bf16: float = 0.0
    kappa: float = A100_KAPPA
    alpha_intra: float = 5e-6  # s per message hop inside a node
    alpha_inter: float = 12e-6  # s per message hop across nodes
    overhead_bytes: float = 1.5 * GiB  # CUDA context, NCCL and cuBLAS workspaces: outside the allocator
    # Host time per eager forward op plus its backward. GPUs launch asynchronously and hide it
    # behind large kernels; a CPU "device" pays it on the critical path, and small models feel it.
    op_overhead_s: float = 0.0
    # Measured per-collective fits {name: {"alpha": s, "beta": bytes/s}} (calibrate.py); when
    # present they replace the link model for groups inside one node.
    collectives: dict = field(default_factory=dict, compare=False, hash=False)
    source: str = ""
    # CPU ranks only (all 0 for accelerators, whose predictions these never touch):
    # cores the ranks share; above one rank per core a step is bound by the total work / cores.
    cores: int = 0
    # {precision: {seq: FLOP/s}}: causal attention, forward + backward, counted as the time model
    # counts it; CPU SDPA kernels reach a fraction of the matmul rate, less at short sequences.
    attn_flops: dict = field(default_factory=dict, compare=False, hash=False)
    # host seconds of a training micro-batch in one process, forward + backward: per decoder layer
    # and for embedding, head and loss (measured; they replace the per-op figure)
    layer_overhead_s: float = 0.0
    head_overhead_s: float = 0.0
    # {world: {tp: {"layer"|"head": {"alpha": s, "per_byte": s/byte}}}}: what a TP(+SP) micro-batch
    # costs beyond its share of compute (DTensor dispatch, the collectives as the runtime issues
    # them), measured in situ with `world` ranks busy; bytes = one micro-batch's activation
    tp_host: dict = field(default_factory=dict, compare=False, hash=False)
    # seconds per local parameter per step (gradient norm + AdamW), measured; 0 = HBM traffic model
    optimizer_s_per_param: float = 0.0
    # host seconds of one pipeline action (a stage's forward, backward, or split input/weight
    # backward of one micro-batch) beyond its compute: torch.distributed.pipelining's bookkeeping
    # and the Gloo send/receive around it. GPUs queue them behind kernels; CPU ranks pay each.
    pp_action_s: float = 0.0
    # {world: {collective: fit}}: Gloo fits measured with that many ranks on the machine; the
    # cost of a collective depends on how many ranks share the cores, not only on its group
    collectives_by_world: dict = field(default_factory=dict, compare=False, hash=False)
    # CPU ranks across nodes, measured (planner/links.py): {kind: {"alpha", "beta": each rank's
    # share}} of a collective over the link between nodes; absent kinds take alpha_inter, inter_bw
    inter_collectives: dict = field(default_factory=dict, compare=False, hash=False)
    generation: str = "cpu"  # ampere | hopper | blackwell: which constants apply; cpu: this-machine
    sms: int = 0  # streaming multiprocessors (wave quantization of GEMMs)
    tile: tuple = (128, 128)  # output tile (rows, cols) of the training GEMM kernels
    pod_gpus: int = 0  # GPUs under one full-bisection fabric; 0 = the whole cluster
    oversubscription: float = 1.0  # above the pod
    # Constants measured by a GPU calibration profile (planner/profile.py): {name: value}
    measured: dict = field(default_factory=dict, compare=False, hash=False)
    # Seconds for a cold torch.compile of one kind of decoder block, forward and backward (what
    # `[parallel] compile_auto` weighs against the run's saving); 0 = unknown: never compiled by it.
    compile_s: float = 0.0
    # CPU ranks: the fraction of a decoder layer's forward + backward that compiled blocks save,
    # {precision: fraction} (GPUs price compile as fused elementwise kernels: kappa_fused)
    cpu_compile_saving: dict = field(default_factory=dict, compare=False, hash=False)
    # Why compile is not priced where a profile says its figures were never measured (a profile
    # fitted to runs that did not compile, `unmeasured.compile`): compile_auto's start-up line
    compile_unmeasured: str = ""
    # CPU ranks: False where `ndtrain calibrate` did not measure this host (the host probe's
    # compute rates or the defaults; host and collective costs unmeasured)
    calibrated: bool = True
    # The board power limit (`nvidia-smi -pl`, `plan --power-limit`), W; 0 = the TDP. Below the TDP
    # compute-bound kernels run at a lower sustained clock (planner/gemm.py, clock_share).
    power_w: float = 0.0

    @property
    def board_w(self) -> float:
        """What one GPU draws while training: its power limit, else its TDP (energy figures)."""
        return self.power_w or self.tdp_w

    def peak(self, precision: str, fp32_matmul: str = "tf32") -> float:
        """Dense matmul FLOP/s in `precision`. fp32 on a GPU runs as `fp32_matmul` says
        (`[parallel] fp32_matmul_precision`): "tf32" on the tensor cores, at half the dense bf16
        rate, or "ieee" on the CUDA cores. CPU ranks have one calibrated fp32 rate (no TF32)."""
        if precision == "fp8":
            if not self.peak_fp8:
                raise NdtrainError(f"{self.name} has no fp8 tensor cores; use --precision bf16")
            return self.peak_fp8
        if precision != "fp32":
            return self.peak_bf16
        if fp32_matmul == "ieee" and self.generation != "cpu":
            # IEEE fp32 over dense bf16, per SM generation (the SKUs of one generation share the
            # ratio but for clocks): NVIDIA's datasheets, FP32 / BF16 tensor TFLOP/s, A100 SXM
            # 19.5 / 312, H100 SXM 67 / 989 (PCIe 51 / 756 prices 51.2, NVL 60 / 835 prices 56.6),
            # HGX B200 75 / 2,250. So TF32 is 8x IEEE on A100 and 7.4x on H100.
            ieee_of_bf16 = {"ampere": 19.5 / 312, "hopper": 67 / 989, "blackwell": 75 / 2250}
            if self.generation not in ieee_of_bf16:
                raise NdtrainError(f"{self.name}: no IEEE fp32 rate for GPU generation {self.generation!r}")
            return self.peak_bf16 * ieee_of_bf16[self.generation]
        return self.peak_fp32 or self.peak_bf16 / 2

    def cpu_mm_eff(self, precision: str) -> float:
        """CPU ranks' fitted GEMM efficiency for `precision` (fp8 computes its remainder in bf16)."""
        return self.mm_eff_bf16 if precision in ("bf16", "fp8") and self.mm_eff_bf16 else self.mm_eff

    def attention_rate(self, precision: str, seq: int) -> float:
        """Measured rate at `seq`, interpolated in log(seq) between measured lengths; the
        matmul rate where nothing was measured."""
        table = sorted((int(s), r) for s, r in self.attn_flops.get(precision, {}).items())
        if not table:
            return self.peak(precision) * self.cpu_mm_eff(precision)
        if seq <= table[0][0]:
            return table[0][1]
        for (s0, r0), (s1, r1) in zip(table, table[1:]):
            if seq <= s1:
                return r0 + (r1 - r0) * math.log(seq / s0) / math.log(s1 / s0)
        return table[-1][1]

    def for_world(self, world: int) -> "Hardware":
        """The collective fits measured with `world` ranks (the nearest measured world at or above
        it, else the largest), for CPU ranks sharing cores; unchanged elsewhere."""
        if not self.collectives_by_world:
            return self
        worlds = sorted(int(w) for w in self.collectives_by_world)
        pick = next((w for w in worlds if w >= world), worlds[-1])
        fits = {**self.collectives, **self.collectives_by_world[str(pick)]}
        return dataclasses.replace(self, collectives=fits)

    def tp_cost(self, world: int, tp: int, part: str, nbytes: float) -> float | None:
        """Measured TP cost of one micro-batch's `part` ("layer" or "head") moving an activation
        of `nbytes`, for `world` ranks (the nearest measured world at or above, else the largest)
        and degree `tp` (the nearest measured degree); None where nothing was measured."""
        if not self.tp_host:
            return None
        worlds = sorted(int(w) for w in self.tp_host)
        table = self.tp_host[str(next((w for w in worlds if w >= world), worlds[-1]))]
        fit = table[str(min((int(t) for t in table), key=lambda t: (abs(math.log(t / tp)), -t)))][part]
        return fit["alpha"] + fit["per_byte"] * nbytes

    @property
    def intra_bw(self) -> float:
        """Per-direction bandwidth a collective reaches between GPUs of one node."""
        return self.nvlink_bw / 2 * NVLINK_EFF

    @property
    def inter_bw(self) -> float:
        return self.nic_bw * NIC_EFF
