"""Calibration of what eager training costs on CPU ranks beyond FLOPs and bytes: the host time of a
plain micro-batch, and the in-situ cost of a tensor-parallel one (imports torch; used only by
`ndtrain calibrate`).

A micro-batch (forward, the loss as the trainer computes it, backward, reading the loss) is timed
with 1 and 4 decoder layers: the slope is one layer, the intercept the embedding, head and loss.
At a tiny width the compute is negligible and this is pure host overhead. Tensor parallelism is
measured the way the runtime runs it (DTensor + sequence parallel, vocab-parallel loss) at two
widths with `world` ranks busy in groups of `tp`; what it costs beyond the plain layer's share of
compute is fitted as alpha + bytes x per_byte, bytes being one micro-batch's activation.
"""

from __future__ import annotations

import contextlib
import time

# (dim, seq) of the two measured shapes: host overhead only, and layers of a few MB whose
# collectives show their per-byte cost
SHAPES = ((64, 8), (320, 128))
BATCH = 2
DEPTHS = (1, 4)


def typical(times: list[float]) -> float:
    """The lower quartile of repeated timings: on a shared machine other jobs only ever add time,
    so the low end estimates the undisturbed cost better than the median."""
    ordered = sorted(times)
    return ordered[(len(ordered) - 1) // 4]


def _config(layers: int, dim: int):
    from ndtrain.model.config import ModelConfig

    return ModelConfig(preset="custom", dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_dim=2 * dim,
                       vocab_size=64, max_seq_len=max(256, SHAPES[-1][1]))


def _llama(layers: int, dim: int):
    from ndtrain.model.llama import build_model

    return build_model(_config(layers, dim), "meta")


def micro_batch_seconds(build, dim: int, seq: int, reps: int, tp: bool = False, sync=None) -> tuple[float, float]:
    """(per layer, per micro-batch outside the layers) seconds; `build(layers, dim)` gives a model."""
    import torch
    import torch.nn.functional as F

    x, y = torch.randint(0, 64, (BATCH, seq)), torch.randint(0, 64, (BATCH, seq))

    def step(model):
        if tp:
            from torch.distributed.tensor.parallel import loss_parallel

            ctx = loss_parallel()
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
            loss.backward()
        loss = loss.detach()
        float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    models = {layers: build(layers, dim) for layers in DEPTHS}
    times: dict = {layers: [] for layers in DEPTHS}
    for rep in range(reps + 1):
        for layers, model in models.items():  # interleaved, so a busy spell hits both depths alike
            if sync:
                sync()
            start = time.perf_counter()
            step(model)
            if rep:  # the first is warm-up
                times[layers].append(time.perf_counter() - start)
    per_depth = {layers: typical(t) for layers, t in times.items()}
    lo, hi = DEPTHS
    layer = max(1e-7, (per_depth[hi] - per_depth[lo]) / (hi - lo))
    return layer, max(1e-7, per_depth[lo] - lo * layer)


def plain_host(reps: int, precision: str = "fp32") -> dict:
    """{"dim,seq": [layer, head]} for SHAPES, one thread, in this process. bf16: parameters and
    activations in bf16, as FSDP2's bf16 policy runs a block (fp32 norms, RoPE and CPU attention
    inside it, as the model does)."""
    import torch

    from ndtrain.model.init import materialize

    def build(layers, dim):
        model = _llama(layers, dim)
        materialize(model, 0, "cpu")
        return model.to(torch.bfloat16) if precision == "bf16" else model

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {f"{d},{s}": list(micro_batch_seconds(build, d, s, reps)) for d, s in SHAPES}
    finally:
        torch.set_num_threads(old)


def tp_host(world: int, tp: int, reps: int) -> dict:
    """{"dim,seq": [layer, head]} under TP(+SP) on this rank of a `world`-rank process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ndtrain.model.init import materialize
    from ndtrain.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("rest", "tp"))

    def build(layers, dim):
        model = _llama(layers, dim)
        apply_tensor_parallel(model, mesh["tp"], True)
        materialize(model, 0, "cpu")
        return model

    return {f"{d},{s}": list(micro_batch_seconds(build, d, s, reps, True, dist.barrier)) for d, s in SHAPES}


def dp_host(world: int, mode: str, reps: int) -> dict:
    """{"dim,seq": [layer, head]} of a training micro-batch (gradients reduced) under the runtime's
    data parallelism: mode "zero3" (dp_shard = world), "ddp" (dp_replicate = world: torch's DDP
    reducer, as the runtime runs plain replication), "replicate" (the same ranks replicated by
    FSDP2: the blocking all-reduce HSDP issues after each block's backward) or "zero3_tp"
    (dp_shard = world / 2 over tensor-parallel pairs: FSDP of DTensor parameters, as 2-D layouts
    run it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ndtrain.model.init import materialize
    from ndtrain.parallel.data_parallel import apply_ddp, apply_fsdp
    from ndtrain.parallel.tensor import apply_tensor_parallel

    tp = 2 if mode == "zero3_tp" else 1
    shape = {"zero3": (1, world, 1), "ddp": (world, 1, 1), "replicate": (world, 1, 1),
             "zero3_tp": (1, world // 2, 2)}[mode]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    def build(layers, dim):
        model = _llama(layers, dim)
        if tp > 1:
            apply_tensor_parallel(model, mesh["tp"], True)
        if mode == "ddp":
            apply_ddp(model, mesh["dp_replicate"].get_group())
        else:
            apply_fsdp(model, mesh["dp_replicate", "dp_shard"], True, "fp32", False)
        materialize(model, 0, "cpu")
        return model

    return {f"{d},{s}": list(micro_batch_seconds(build, d, s, reps, tp > 1, dist.barrier)) for d, s in SHAPES}


def layer_param_bytes(dim: int) -> int:
    """fp32 bytes of one decoder layer of the calibration model."""
    from ndtrain.model.config import layer_params

    return 4 * layer_params(_config(1, dim), 0)


def fit_dp(base: dict, measured: dict, mode: str, world: int, share: float, replicated: dict | None = None) -> dict:
    """In-situ collective fits {kind: {"alpha", "beta"}} in comm.py's ring terms: what the runtime's
    gradient reduction (and ZeRO-3 gathers) add to a layer beyond `base` (the plain micro-batch,
    `share` times slower when ranks outnumber cores; for "zero3_tp" the TP micro-batch measured in
    the same ranks, share 1), split over the collectives it issues (ZeRO-3: two all-gathers and a
    reduce-scatter of the layer per step; DDP: one all-reduce). "zero3_tp" fits the "_tp" kinds,
    used where FSDP shards tensor-parallel parameters.

    The runtime's FSDP reduce-scatters through torch's all-to-all on Gloo
    (parallel/gloo_reduce_scatter.py), moving (k-1)/k of the gradients where an all-reduce moves
    2(k-1)/k. So where FSDP2's replication was measured on the same ranks (`replicated`: mode
    "replicate", one blocking all-reduce per block, issued where FSDP issues its reduce-scatter),
    ZeRO-3's reduce-scatter costs half that all-reduce and the rest of ZeRO-3's extra is split over
    its two all-gathers (prefetched, so what they leave exposed); an even three-way split made
    gathers look dear and the reduce-scatter cheap, which ranked ZeRO-1 above DDP here. Two
    all-reduce fits: "all_reduce" from mode "replicate" (FSDP2's blocking one, as HSDP and bf16
    replication run it) and "all_reduce_ddp" from mode "ddp", the DDP reducer the runtime runs fp32
    plain replication on (Layout.on_ddp_reducer), whose bucketed all-reduces overlap the backward
    and so add less to a layer."""
    tp = 2 if mode == "zero3_tp" else 1
    k = world // tp
    nbytes = [layer_param_bytes(d) / tp for d, _ in SHAPES]

    def extra(timed: dict) -> list[float]:  # what the reduction adds to a layer, per shape
        return [max(0.0, timed[f"{d},{s}"][0] - share * base[f"{d},{s}"][0]) for d, s in SHAPES]

    def ring(extras: list[float], hops: int) -> dict:
        """alpha + per_byte x bytes through the two shapes, in comm.py's ring terms:
        hops (k-1) alpha + hops (k-1)/k n / beta."""
        (n0, n1), (e0, e1) = nbytes, extras
        per_byte = max(1e-12, (e1 - e0) / (n1 - n0))
        alpha = max(1e-7, e0 - per_byte * n0)
        return {"alpha": alpha / (hops * (k - 1)), "beta": hops * (k - 1) / k / per_byte}

    if mode == "ddp":
        return {"all_reduce_ddp": ring(extra(measured), 2)}
    if mode == "replicate":
        return {"all_reduce": ring(extra(measured), 2)}
    if replicated is None or tp > 1:
        fit = ring([e / 3 for e in extra(measured)], 1)
        suffix = "_tp" if tp > 1 else ""
        return {"all_gather" + suffix: fit, "reduce_scatter" + suffix: fit}
    rs = [a / 2 for a in extra(replicated)]  # half the all-reduce's bytes; the gathers share the rest
    return {"all_gather": ring([(z - r) / 2 for z, r in zip(extra(measured), rs)], 1), "reduce_scatter": ring(rs, 1)}


def fit_tp(plain: dict, measured: dict, tp: int, share: float) -> dict:
    """{"layer"|"head": {"alpha": s, "per_byte": s/byte}}: the TP micro-batch's cost beyond its
    share of the plain compute (1/tp of it, `share` times slower when ranks outnumber cores)."""
    out = {}
    for i, part in enumerate(("layer", "head")):
        pts = []
        for d, s in SHAPES:
            key = f"{d},{s}"
            extra = max(0.0, measured[key][i] - share * plain[key][i] / tp)
            pts.append((BATCH * s * d * 4, extra))
        (n0, e0), (n1, e1) = pts
        per_byte = max(0.0, (e1 - e0) / (n1 - n0))
        out[part] = {"alpha": max(0.0, e0 - per_byte * n0), "per_byte": per_byte}
    return out


def optimizer_seconds_per_param(params: int = 1 << 22, tensors: int = 16, reps: int = 5) -> float:
    """One thread's seconds per parameter of what the trainer does to every parameter each step:
    the gradient norm and a fused AdamW step (fp32), the trainer's default
    (`optimizer.implementation = "fused"`; foreach costs ~2x on this CPU)."""
    import torch

    from ndtrain.compat.torch import foreach_norm

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ps = [torch.zeros(params // tensors, requires_grad=True) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)

        def step():
            foreach_norm([p.grad for p in ps])
            opt.step()

        step()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return typical(times) / params
    finally:
        torch.set_num_threads(old)
