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

from ndtrain.layout import Layout
from ndtrain.layout import schedules as registry
from ndtrain.layout.flops import average_layer_forward_flops, head_forward_flops
from ndtrain.layout.fp8 import fp8_matmul_fraction
from ndtrain.planner.comm import collective_time as coll
from ndtrain.planner.memory import activation_bytes, device_params
from ndtrain.planner.problem import Problem, Split
from ndtrain.planner.problem import stage_split as _stage_split

OPTIMIZER_BYTES_PER_PARAM = 30  # Adam: read fp32 param, m, v, grad; write param, m, v, bf16 copy
# Eager forward ops per decoder layer (norms, q/k/v/o, RoPE, attention, SwiGLU, residuals) and for
# the head and loss; Hardware.op_overhead_s is the host time of one such op plus its backward.
# Only matters where launches are not hidden behind large kernels (CPU ranks).
OPS_PER_LAYER = 32
OPS_HEAD = 8


def layer_flops(pb: Problem) -> tuple[float, float]:
    """(matmul, attention core) forward FLOPs per token of an average layer: ndtrain.layout's
    count, with the causal half of attention for flash kernels (they skip the masked half) and
    the full s x s for the unfused kernels of 2021."""
    key = (pb.seq, pb.stack.flash_attention)
    cached = pb.__dict__.setdefault("_layer_flops", {})
    if key not in cached:
        cached[key] = average_layer_forward_flops(pb.cfg, pb.seq, "causal" if pb.stack.flash_attention else "full")
    return cached[key]


def layer_costs(pb: Problem, lay: Layout) -> dict:
    """Seconds per layer per micro-batch on one device (an average layer for MoE models)."""
    sh, hw, st, elt = pb.shape, pb.hw, pb.stack, pb.act_bytes
    t, c, b = lay.tp, lay.cp, lay.mb
    sp = lay.sp and t > 1
    tok = b * pb.seq / c
    rate = matmul_rate(pb, t)
    mm_flops, attn_flops = layer_flops(pb)
    # MoE layers run replicated over tp (each tp rank routes the whole sequence): their share of
    # the matmuls is not divided by t.
    moe = sh.mm_moe_layer / sh.mm_params_layer if sh.mm_params_layer else 0.0
    mm = tok * mm_flops * ((1 - moe) / t + moe) / rate
    # fp8 recipes (DeepSeek-V3, Transformer Engine) keep attention in bf16
    attn_rate = hw.attention_rate("bf16" if pb.precision == "fp8" else pb.precision, pb.seq)
    attn = tok * attn_flops / t / attn_rate
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
    gemm = 3 * tok * head_forward_flops(pb.cfg) / lay.tp / (hw.peak(head_precision) * hw.mm_eff)
    loss = 2 * (elt + 8) * tok * sh.vocab / lay.tp / hw.hbm_bw  # fp32 softmax over the logits
    return gemm + loss + (hw.head_overhead_s or OPS_HEAD * hw.op_overhead_s) + tp_head(pb, lay)


def stage_split(pb: Problem, lay: Layout, lc: dict | None = None) -> Split | None:
    """The runtime's stage partition (per pipeline rank); `lc` is accepted for old callers."""
    return _stage_split(pb, lay)


def bubble_time(schedule: str, p: int, v: int, f: float, b: float, w: float) -> float:
    """Idle time per step on the critical rank (the schedule registry's rule)."""
    return registry.get(schedule).bubble_time(p, v, f, b, w)


def dp_comm(pb: Problem, lay: Layout, layers_on_device: int) -> tuple[float, float, float, float]:
    """Seconds of data-parallel traffic for the device holding the embedding: (per micro-batch
    in its forward, per micro-batch in its backward, per step on the gradient side, per step on
    the parameter side)."""
    hw = pb.hw
    t, c, ep = lay.tp, lay.cp, lay.ep
    dense, expert = device_params(pb.shape, lay, layers_on_device, True, lay.pp == 1)
    pbytes = 4 if pb.precision == "fp32" else 2
    gbytes = 4 if pb.precision == "fp32" else pb.stack.grad_reduce_bytes
    zero, S, R = lay.effective_zero, lay.shard_degree, lay.dp_replicate
    # CPU ranks count what the runtime does: one collective per FSDP unit (each layer, plus the
    # root), whose latency is milliseconds there. Accelerators keep one bucketed collective per
    # step, as their fits were made (their latency is microseconds).
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
    # The ZeRO stage as the runtime runs it (parallel/data_parallel.py): gradients reduce-scattered
    # after every micro-batch at ZeRO-2/3, once per step at ZeRO-1 and in any pipeline (torch's
    # schedules reduce after the last micro-batch).
    per_mb = lay.grads_sharded_per_microbatch
    if zero in (1, 2):  # parameters gathered once per step, for the first forward
        return 0.0, (rs if per_mb else 0.0), (rep if per_mb else rs + rep), ag
    again = ag if lay.reshards_after_forward else 0.0  # gathered again for the backward
    if per_mb:
        return ag, again + rs, rep, 0.0
    return ag, again, rs + rep, 0.0


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


def busy_and_bubble(pb: Problem, lay: Layout, lc: dict, split: Split) -> tuple[float, float, float, int]:
    """(one micro-batch on the critical device, bubble, scale in layers, layers on that device)."""
    p = lay.pp
    per_layer = lc["F"] + lc["B"] + lc["W"]
    if p == 1:
        dev, n_dev = pb.shape.layers * per_layer + lc["head"], pb.shape.layers
    else:
        dev, n_dev = max(split.first_work * per_layer, split.last_work * per_layer + lc["head"]), split.first
    scale = dev / per_layer  # the critical device in units of one average layer
    bubble = bubble_time(lay.schedule, p, lay.v, lc["F"] * scale, lc["B"] * scale, lc["W"] * scale)
    return dev, bubble, scale, n_dev


def step_breakdown(pb: Problem, lay: Layout, lc: dict | None = None, split: Split | None = None,
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
        kind = registry.get(lay.schedule).kind
        hops = 2 * (2 * p - 1) if kind == "v" else 2 * (p * v - 1) if kind == "interleaved" else 2 * (p - 1)
        steady = max(0.0, 2 * v * hop - dev) * m  # sends and receives overlap compute unless larger
        pp = hops * hop + steady

    key = ("dp", lay.tp, lay.cp, lay.ep, lay.effective_zero, lay.shard_degree, lay.dp_replicate, p, n_dev,
           lay.grads_sharded_per_microbatch, lay.reshards_after_forward)
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
    local = dense / (lay.shard_degree if lay.effective_zero else 1) + \
        expert / (lay.expert_shard_degree if lay.effective_zero else 1)
    optimizer = local * pb.hw.optimizer_s_per_param or OPTIMIZER_BYTES_PER_PARAM * local / pb.hw.hbm_bw

    busy = m * dev
    head_here = p == 1 or split.last_work * per_layer + lc["head"] >= split.first_work * per_layer
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
        "micro_batches": m, "stage_layers": list(split.ranks), "stage_counts": list(split.counts),
    }
