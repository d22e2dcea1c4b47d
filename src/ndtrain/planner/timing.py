"""Step time: compute, exposed communication, pipeline bubble, optimizer.

Per layer and micro-batch on one device the work splits into F (forward), B (backward to the
input) and W (backward to the weights), the split the zero-bubble schedules are defined on:
  matmuls      2 x tokens x params / tp per pass, at peak x mm_eff
  attention    4 x tokens x s x h / tp forward, twice that backward; causal flash kernels skip
               the masked half, the unfused kernels of 2021 do not
  elementwise  kappa x (activation bytes) / HBM bandwidth over F+B (norms, activations,
               softmax, residuals are memory-bound: their traffic scales with what they store)
Communication inside a layer (TP all-reduce or all-gather/reduce-scatter, CP K/V ring passes, EP
all-to-all) sits on the critical path: TP is not overlapped by the stack, CP ring passes hide
behind the attention block they feed, EP hides only under DualPipeV (which overlaps one
micro-batch's forward with another's backward). Data-parallel traffic hides behind the backward
(gradients) or forward (parameter gathers) except for the first/last layer's share.
"""

from __future__ import annotations

from ndtrain.layout.fp8 import fp8_matmul_fraction
from ndtrain.planner.comm import collective_time as coll
from ndtrain.planner.layout import INTERLEAVED, V_SHAPED, Layout
from ndtrain.planner.memory import activation_bytes, device_params
from ndtrain.planner.problem import Problem, partition

OPTIMIZER_BYTES_PER_PARAM = 30  # Adam: read fp32 param, m, v, grad; write param, m, v, bf16 copy
# Eager forward ops per decoder layer (norms, q/k/v/o, RoPE, attention, SwiGLU, residuals) and for
# the head and loss; Hardware.op_overhead_s is the host time of one such op plus its backward.
# Only matters where launches are not hidden behind large kernels (CPU ranks).
OPS_PER_LAYER = 32
OPS_HEAD = 8


def layer_costs(pb: Problem, lay: Layout) -> dict:
    """Seconds per layer per micro-batch on one device (an average layer for MoE models)."""
    sh, hw, st, elt = pb.shape, pb.hw, pb.stack, pb.act_bytes
    t, c, b = lay.tp, lay.cp, lay.mb
    sp = lay.sp and t > 1
    tok = b * pb.seq / c
    mm = 2 * tok * sh.mm_params_layer / t / matmul_rate(pb, t)
    # fp8 recipes (DeepSeek-V3, Transformer Engine) keep attention in bf16
    attn_rate = hw.attention_rate("bf16" if pb.precision == "fp8" else pb.precision, pb.seq)
    attn = 4 * tok * pb.seq * sh.heads * sh.head_dim / t / attn_rate * (0.5 if st.flash_attention else 1.0)
    a_none = activation_bytes(sh, st, pb.seq, b, t, sp, c, "none", elt)
    elem = hw.kappa * a_none / hw.hbm_bw
    elem += hw.layer_overhead_s or OPS_PER_LAYER * hw.op_overhead_s
    fwd = mm + attn + elem / 3
    rec = 0.0
    if lay.ac == "full":
        rec = fwd
    elif lay.ac == "selective":
        a_sel = activation_bytes(sh, st, pb.seq, b, t, sp, c, "selective", elt)
        rec = hw.kappa * (a_none - a_sel) / hw.hbm_bw / 3 + (0.0 if st.flash_attention else attn)
    comm_f = comm_b = 0.0
    tp = cp = ep = 0.0
    n_rec = 1 if lay.ac == "full" else 0
    if t > 1:
        ar = tp_all_reduce(pb, t, tok * sh.dim * elt)  # = all-gather + reduce-scatter with SP
        tp = ar * (4 + 2 * n_rec)
        comm_f += 2 * ar
        comm_b += 2 * ar * (1 + n_rec)
    if c > 1:
        kv = 2 * tok * sh.dim * sh.gqa_ratio * elt / min(t, sh.kv_heads)
        hop = coll(hw, "p2p", c, t, kv)
        blk = attn / c
        f_exp = (c - 1) * max(0.0, hop - blk)
        b_exp = (c - 1) * max(0.0, 2 * hop - 2 * blk)  # K/V and their gradients travel back
        cp = f_exp * (1 + n_rec) + b_exp
        comm_f += f_exp
        comm_b += b_exp + f_exp * n_rec
    if lay.ep > 1 and sh.moe_layer_frac:
        wire = 1.5 if pb.precision == "fp8" else elt  # fp8 training dispatches in fp8, combines in bf16
        a2a = coll(hw, "all_to_all", lay.ep, t, tok * sh.active_experts * sh.dim * wire / t) * sh.moe_layer_frac
        total = a2a * (4 + 2 * n_rec)  # dispatch + combine, forward and backward
        if lay.schedule == "DualPipeV" and lay.pp > 1:
            total = max(0.0, total - (3 * mm + 3 * attn + elem + rec))
        ep = total
        comm_f += total / 2
        comm_b += total / 2
    return {"F": fwd + comm_f, "B": mm + 2 * attn + 2 * elem / 3 + rec + comm_b, "W": mm,
            "compute": 3 * mm + 3 * attn + elem + rec, "recompute": rec, "tp": tp, "cp": cp, "ep": ep,
            "head": head_cost(pb, lay)}


def matmul_rate(pb: Problem, t: int) -> float:
    """FLOP/s of a decoder layer's matmuls. Under fp8 only the Linear layers that the runtime
    converts (layout/fp8.py, the same rule) run at the fp8 peak; the rest, routed experts
    included, at the bf16 peak."""
    hw = pb.hw
    if pb.precision != "fp8":
        return hw.peak(pb.precision) * hw.mm_eff
    f = fp8_matmul_fraction(pb.cfg, t)
    return hw.mm_eff / (f / hw.peak("fp8") + (1 - f) / hw.peak("bf16"))


def tp_all_reduce(pb: Problem, t: int, nbytes: float) -> float:
    """One of a TP layer's four all-reduces (or all-gather + reduce-scatter pairs) of `nbytes`.
    Where the machine measured what a TP layer costs beyond its share of compute (CPU ranks, where
    DTensor dispatch and Gloo latency dominate), a quarter of that; else the alpha-beta collective."""
    hw = pb.hw
    measured = hw.tp_cost(pb.world, t, "layer", nbytes)
    if measured is None:
        return coll(hw, "all_reduce", t, 1, nbytes)
    return measured / 4


def tp_head(pb: Problem, lay: Layout) -> float:
    """What embedding, head and vocab-parallel loss cost a TP micro-batch beyond its share of
    compute, where measured (CPU ranks); 0 elsewhere."""
    if lay.tp == 1:
        return 0.0
    nbytes = lay.mb * pb.seq / lay.cp * pb.shape.dim * pb.act_bytes
    return pb.hw.tp_cost(pb.world, lay.tp, "head", nbytes) or 0.0


def head_cost(pb: Problem, lay: Layout) -> float:
    """Output layer + loss per micro-batch, forward and backward (never recomputed)."""
    sh, hw, elt = pb.shape, pb.hw, pb.act_bytes
    tok = lay.mb * pb.seq / lay.cp
    head_precision = "bf16" if pb.precision == "fp8" else pb.precision  # the head never runs in fp8
    gemm = 6 * tok * sh.dim * sh.vocab / lay.tp / (hw.peak(head_precision) * hw.mm_eff)
    loss = 2 * (elt + 8) * tok * sh.vocab / lay.tp / hw.hbm_bw  # fp32 softmax over the logits
    return gemm + loss + (hw.head_overhead_s or OPS_HEAD * hw.op_overhead_s) + tp_head(pb, lay)


def stage_split(pb: Problem, lay: Layout, lc: dict | None = None) -> tuple[int, int] | None:
    lc = lc or layer_costs(pb, lay)
    per_layer = lc["F"] + lc["B"] + lc["W"]
    head_layers = round(lc["head"] / per_layer * 20) / 20
    return partition(pb.shape.layers, lay.pp, head_layers, pb.strict)


def bubble_time(schedule: str, p: int, v: int, f: float, b: float, w: float) -> float:
    """Idle time per step on the critical rank, from per-micro-batch device times F, B, W."""
    if p == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) * (f + b + w)
    if schedule == "Interleaved1F1B":
        return (p - 1) * (f + b + w) / v
    if schedule == "InterleavedZeroBubble":  # ZB-H1 per chunk: W passes fill 2/3 of the bubble
        return (p - 1) * max(f + b - w, 0.0) / v
    if schedule == "ZBVZeroBubble":  # Qi et al. 2024: zero when F = B = W, else what W cannot fill
        return (p - 1) * max(f + b - 2 * w, 0.0)
    if schedule == "DualPipeV":  # DeepSeek-V3 Table 2, (PP/2-1)(F&B + B - 3W) in chunk times
        return (p - 1) * max(f + 2 * b - w, 0.0) / 2
    raise ValueError(schedule)


def dp_comm(pb: Problem, lay: Layout, layers_on_device: int) -> tuple[float, float, float, float]:
    """Seconds of data-parallel traffic for the device holding the embedding: (per micro-batch
    in its forward, per micro-batch in its backward, per step on the gradient side, per step on
    the parameter side)."""
    hw = pb.hw
    t, c, ep = lay.tp, lay.cp, lay.ep
    dense, expert = device_params(pb.shape, lay, layers_on_device, True, lay.pp == 1)
    pbytes = 4 if pb.precision == "fp32" else 2
    gbytes = 4 if pb.precision == "fp32" else pb.stack.grad_reduce_bytes
    zero, S, R = lay.eff_zero, lay.shard_degree, lay.dp_replicate
    # CPU ranks count what the runtime does: one collective per FSDP unit (each layer, plus the
    # root), whose latency is milliseconds there, and with gradient accumulation a reduce-scatter
    # only on the last micro-batch. Accelerators keep one bucketed collective per step and a
    # reduction every micro-batch, as their fits were made (their latency is microseconds).
    units = layers_on_device + 1 if hw.cores else 1

    def dense_coll(kind, ranks, stride, nbytes):
        return units * coll(hw, kind, ranks, stride, nbytes / units)

    if zero == 0:
        ranks = R * c  # cp ranks hold the same parameters and reduce with the replicas
        grad = dense_coll("all_reduce", ranks, t, gbytes * dense) + coll(hw, "all_reduce", ranks // ep, t * ep, gbytes * expert)
        return 0.0, 0.0, grad, 0.0
    se = max(1, S // ep)
    # FSDP of tensor-parallel (DTensor) parameters costs its own, where it was measured (CPU ranks)
    sfx = "_tp" if t > 1 and "all_gather_tp" in hw.collectives else ""
    rs = dense_coll("reduce_scatter" + sfx, S, t, gbytes * dense) + coll(hw, "reduce_scatter", se, t * ep, gbytes * expert)
    ag = dense_coll("all_gather" + sfx, S, t, pbytes * dense) + coll(hw, "all_gather", se, t * ep, pbytes * expert)
    if units == 1:
        rep = coll(hw, "all_reduce", R, t * S, gbytes * (dense / S + expert / se))  # HSDP: across replicas
    else:
        rep = dense_coll("all_reduce", R, t * S, gbytes * dense / S) + coll(hw, "all_reduce", R, t * S, gbytes * expert / se)
    if zero == 1:
        return 0.0, 0.0, rs + rep, ag
    if zero == 2:
        return 0.0, rs, rep, ag
    if hw.cores:
        return ag, ag, rs + rep, 0.0
    return ag, ag + rs, rep, 0.0


def cores_shared(pb: Problem) -> float:
    """Ranks per core when CPU ranks outnumber the machine's cores (1 on accelerators)."""
    cores = pb.hw.cores
    return pb.world / cores if cores and pb.world > cores else 1.0


def dp_overlaps(pb: Problem) -> bool:
    """Whether data-parallel traffic hides behind compute. On CPU ranks a Gloo collective is work
    for a core (copies through the loopback, reductions): it overlaps only where every rank has a
    spare core for it."""
    if pb.hw.cores and 2 * pb.world > pb.hw.cores:
        return False
    return pb.stack.dp_overlap


def _memo(cache: dict | None, key, fn, *args):
    if cache is None:
        return fn(*args)
    val = cache.get(key)
    if val is None:
        val = cache[key] = fn(*args)
    return val


def busy_and_bubble(pb: Problem, lay: Layout, lc: dict, split: tuple[int, int]) -> tuple[float, float, float, int]:
    """(one micro-batch on the critical device, bubble, scale in layers, layers on that device)."""
    p = lay.pp
    per_layer = lc["F"] + lc["B"] + lc["W"]
    if p == 1:
        dev, n_dev = pb.shape.layers * per_layer + lc["head"], pb.shape.layers
    else:
        dev, n_dev = max(split[0] * per_layer, split[1] * per_layer + lc["head"]), split[0]
    scale = dev / per_layer  # the critical device in units of one average layer
    bubble = bubble_time(lay.schedule, p, lay.v, lc["F"] * scale, lc["B"] * scale, lc["W"] * scale)
    return dev, bubble, scale, n_dev


def step_breakdown(pb: Problem, lay: Layout, lc: dict | None = None, split: tuple[int, int] | None = None,
                   cache: dict | None = None) -> dict:
    """Seconds per optimizer step, broken down. `cache` (any dict kept across calls for one
    problem) memoises the pieces many layouts share."""
    lc = lc or layer_costs(pb, lay)
    split = split or stage_split(pb, lay, lc)
    p, v = lay.pp, lay.v
    m = lay.micro_batches(pb.global_batch)
    per_layer = lc["F"] + lc["B"] + lc["W"]
    dev, bubble, scale, n_dev = busy_and_bubble(pb, lay, lc, split)
    f, b, w = lc["F"] * scale, lc["B"] * scale, lc["W"] * scale

    pp = 0.0
    if p > 1:
        msg = lay.mb * pb.seq / lay.cp * pb.shape.dim * pb.act_bytes / lay.tp  # scattered over tp
        hop = _memo(cache, ("p2p", p, lay.tp * lay.cp * lay.dp, msg), coll, pb.hw, "p2p", p, lay.tp * lay.cp * lay.dp, msg)
        hops = 2 * (2 * p - 1) if lay.schedule in V_SHAPED else 2 * (p * v - 1) if lay.schedule in INTERLEAVED else 2 * (p - 1)
        steady = max(0.0, 2 * v * hop - dev) * m  # sends and receives overlap compute unless larger
        pp = hops * hop + steady

    key = ("dp", lay.tp, lay.cp, lay.ep, lay.eff_zero, lay.shard_degree, lay.dp_replicate, p, n_dev)
    mb_f, mb_b, grad_c, param_c = _memo(cache, key, dp_comm, pb, lay, n_dev)
    if dp_overlaps(pb):
        # gathers hide behind the forward, gradient reductions behind the backward that produces
        # them; what the last micro-batch leaves of its windows hides the once-per-step traffic
        dp = m * (max(0.0, mb_f - f) + max(0.0, mb_b - (b + w)) + (mb_f + mb_b) / n_dev)
        dp += max(0.0, grad_c - max(0.0, b + w - mb_b)) + grad_c / n_dev
        dp += max(0.0, param_c - max(0.0, f - mb_f)) + param_c / n_dev
    else:
        dp = m * (mb_f + mb_b) + grad_c + param_c

    dense, expert = device_params(pb.shape, lay, n_dev, True, p == 1)
    local = (dense + expert) / (lay.shard_degree if lay.eff_zero else 1)
    optimizer = local * pb.hw.optimizer_s_per_param or OPTIMIZER_BYTES_PER_PARAM * local / pb.hw.hbm_bw

    busy = m * dev
    head_here = p == 1 or split[1] * per_layer + lc["head"] >= split[0] * per_layer
    tp_fixed = m * tp_head(pb, lay) if head_here else 0.0  # in lc["head"], so in busy: move it to comm
    # Layer communication as a share of the busy time (the head counted as layer-equivalents:
    # the accelerator fits were made so); CPU ranks, whose compute is stretched apart from their
    # comm, count exactly the layers on the device.
    if pb.hw.cores:
        comm = {k: m * (dev - lc["head"] * head_here) / per_layer * lc[k] for k in ("tp", "cp", "ep")}
    else:
        comm = {k: busy * lc[k] / per_layer for k in ("tp", "cp", "ep")}
    comm["tp"] += tp_fixed
    inner = sum(comm.values()) if pb.hw.cores else busy * ((lc["tp"] + lc["cp"] + lc["ep"]) / per_layer) + tp_fixed
    compute, recompute = busy - inner, m * scale * lc["recompute"]
    total = busy + bubble + pp + dp + optimizer
    share = cores_shared(pb)
    if share > 1:
        # More ranks than cores: each rank computes `share` times slower while all are busy. In a
        # pipeline's fill and drain only a fraction f of the stages work, at max(1, f x share)
        # times their full speed; over the ramps (f from 0 to 1) that leaves bubble / share of the
        # bubble, the rest being filled by other ranks. The step is never below the critical path
        # at full speed. Collectives are costed with fits measured at this rank count
        # (Hardware.for_world), which already include the sharing.
        compute, recompute, optimizer = share * compute, share * recompute, share * optimizer
        total = max(total, compute + inner + pp + dp + optimizer + bubble / share)
        bubble = total - (compute + inner + pp + dp + optimizer)
    return {
        "total": total, "compute": compute, "recompute": recompute,
        "exposed_comm": inner + pp + dp, "bubble": bubble, "optimizer": optimizer,
        "comm": {**comm, "pp": pp, "dp": dp},
        "micro_batches": m, "stage_layers": list(split) if p > 1 else [pb.shape.layers],
    }
