"""Step time: the critical device's micro-batches, the pipeline bubble, exposed pipeline and
data-parallel traffic, the optimizer.

Per-layer costs (F, B, W and the communication inside a layer) are planner/layer.py's. Here:
  PP  one activation per stage boundary per micro-batch and pass; a stack that overlaps p2p pays
      the fill/drain hops only (the steady state hides behind compute unless a send is longer
      than the chunk), one that does not (2021) pays every send and receive
  DP  one collective per unit (a layer's FSDP unit or bucket: latency grows with the group);
      gradients reduced behind the backward that produces them, parameters gathered behind the
      forward, each where the stack overlaps it; the first/last unit never hides; hidden traffic
      costs `contention` of its time as compute
The step: m x (critical device's F+B+W) + bubble + exposed PP, DP + optimizer (Adam, 30 bytes
per local parameter through HBM). CPU ranks keep their calibrated rules (cores shared, Gloo
collectives exposed where ranks have no spare core).
"""

from __future__ import annotations

from ndtrain.layout import Layout
from ndtrain.layout import schedules as registry
from ndtrain.planner.comm import collective_time as _coll
from ndtrain.planner.layer import layer_costs, tp_head
from ndtrain.planner.memory import device_params
from ndtrain.planner.problem import Problem, Split, stage_split
from ndtrain.planner.traffic import whole_gathers

OPTIMIZER_BYTES_PER_PARAM = 30  # Adam: read fp32 param, m, v, grad; write param, m, v, bf16 copy


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
    if pb.stack.pp_inside_dp:  # data-parallel peers are a whole pipeline apart
        t = t * lay.pp
    # One collective per unit, as the runtimes issue them: FSDP wraps each layer (plus the root);
    # DDP and Megatron's distributed optimizer bucket about a layer's worth. Each pays the
    # group's latency, which grows with its rank count.
    units = layers_on_device + 1
    k = pb.k if pb.gpu else None

    def coll(kind, ranks, stride, nbytes):
        return _coll(hw, kind, ranks, stride, nbytes, k)

    def dense_coll(kind, ranks, stride, nbytes):
        return units * coll(kind, ranks, stride, nbytes / units)

    if zero == 0:
        ranks = R * c  # cp ranks hold the same parameters and reduce with the replicas
        # torch's DDP reducer (fp32 plain replication) overlaps its all-reduces with the backward:
        # its own in-situ fit where calibration timed it, FSDP2's blocking one elsewhere.
        ddp = lay.on_ddp_reducer(pb.cfg.is_moe, pb.precision) and "all_reduce_ddp" in hw.collectives
        ar = "all_reduce_ddp" if ddp else "all_reduce"
        grad = dense_coll(ar, ranks, t, gbytes * dense) + coll(ar, ranks // ep, t * ep, gbytes * expert)
        return 0.0, 0.0, grad, 0.0
    se = max(1, S // ep)
    # FSDP of tensor-parallel (DTensor) parameters costs its own, where it was measured (CPU ranks)
    sfx = "_tp" if t > 1 and "all_gather_tp" in hw.collectives else ""
    rs = dense_coll("reduce_scatter" + sfx, S, t, gbytes * dense) + coll("reduce_scatter", se, t * ep, gbytes * expert)
    ag = dense_coll("all_gather" + sfx, S, t, pbytes * dense) + coll("all_gather", se, t * ep, pbytes * expert)
    # HSDP: the shard all-reduced across replicas
    rep = dense_coll("all_reduce", R, t * S, gbytes * dense / S) + coll("all_reduce", R, t * S, gbytes * expert / se)
    # The ZeRO stage as the runtime runs it (parallel/data_parallel.py): gradients reduce-scattered
    # after every micro-batch at ZeRO-2/3, once per step at ZeRO-1 and in any pipeline (torch's
    # schedules reduce after the last micro-batch).
    per_mb = lay.grads_sharded_per_microbatch
    if zero in (1, 2):  # parameters gathered once per step, for the first forward
        return 0.0, (rs if per_mb else 0.0), (rep if per_mb else rs + rep), ag
    # ZeRO-3: the gathers the runtime issues a step (planner/traffic.py), at most one whole one in
    # each micro-batch's forward, the rest for its backward
    per_mb_gathers = whole_gathers(pb, lay, layers_on_device) / lay.micro_batches(pb.global_batch)
    fwd = min(1.0, per_mb_gathers)
    again = ag * (per_mb_gathers - fwd)
    if per_mb:
        return ag * fwd, again + rs, rep, 0.0
    return ag * fwd, again, rs + rep, 0.0


def fsdp_copy_seconds(pb: Problem, lay: Layout, params: float, m: int, layers: int) -> float:
    """HBM seconds per step of FSDP2's copies on the compute stream (Stack.fsdp_copies): each
    all-gather copied out of its flat buffer into `params` parameters (read + write), each
    reduce-scatter's input copied in and cast to the reduce dtype (read the gradient, write it).
    The gathers are planner/traffic.py's (ZeRO-3: about two a micro-batch, fewer inside a
    pipeline; ZeRO-1/2: one a step); gradients reduce every micro-batch where they are sharded
    per micro-batch."""
    if not pb.gpu or not pb.stack.fsdp_copies or not lay.effective_zero or lay.shard_degree <= 1:
        return 0.0
    pbytes = 4 if pb.precision == "fp32" else 2
    gbytes = 4 if pb.precision == "fp32" else pb.stack.grad_reduce_bytes
    gather, reduce = 2 * pbytes * params, (pbytes + gbytes) * params
    gathers = whole_gathers(pb, lay, layers)
    reduces = m if lay.grads_sharded_per_microbatch else 1
    return (gathers * gather + reduces * reduce) / (pb.hw.hbm_bw * pb.k["hbm_eff"])


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
    bubble = bubble_time(lay.pp_schedule, p, lay.pp_virtual_stages, lc["F"] * scale, lc["B"] * scale, lc["W"] * scale)
    return dev, bubble, scale, n_dev


def step_breakdown(pb: Problem, lay: Layout, lc: dict | None = None, split: Split | None = None,
                   cache: dict | None = None) -> dict:
    """Seconds per optimizer step, broken down. `cache` (any dict kept across calls for one
    problem) memoises the pieces many layouts share."""
    lc = lc or layer_costs(pb, lay)
    split = split or stage_split(pb, lay)
    p, v = lay.pp, lay.pp_virtual_stages
    m = lay.micro_batches(pb.global_batch)
    per_layer = lc["F"] + lc["B"] + lc["W"]
    dev, bubble, scale, n_dev = busy_and_bubble(pb, lay, lc, split)
    f, b, w = lc["F"] * scale, lc["B"] * scale, lc["W"] * scale

    k = pb.k if pb.gpu else None
    pp = 0.0
    if p > 1:
        msg = lay.micro_batch * pb.seq / lay.cp * pb.shape.dim * pb.act_bytes / lay.tp  # scattered over tp
        stride = lay.tp * lay.cp * (1 if pb.stack.pp_inside_dp else lay.dp)
        hop = _memo(cache, ("p2p", p, stride, msg), _coll, pb.hw, "p2p", p, stride, msg, k)
        kind = registry.get(lay.pp_schedule).kind
        hops = 2 * (2 * p - 1) if kind == "v" else 2 * (p * v - 1) if kind == "interleaved" else 2 * (p - 1)
        if pb.stack.pp_overlap or not pb.gpu:
            steady = max(0.0, 2 * v * hop - dev) * m  # sends and receives overlap compute unless larger
        else:
            steady = 2 * v * hop * m  # blocking sends and receives: every one on the critical path
        pp = hops * hop + steady
        if not pb.gpu:  # every stage action's host bookkeeping (Hardware.pp_action_s)
            actions = m * v * (3 if registry.get(lay.pp_schedule).split_backward else 2)
            pp += actions * pb.hw.pp_action_s

    key = ("dp", lay.tp, lay.cp, lay.ep, lay.effective_zero, lay.shard_degree, lay.dp_replicate, p, n_dev,
           lay.grads_sharded_per_microbatch, lay.reshards_after_forward, lay.pp_virtual_stages,
           lay.micro_batches(pb.global_batch),
           lay.on_ddp_reducer(pb.cfg.is_moe, pb.precision))
    mb_f, mb_b, grad_c, param_c = _memo(cache, key, dp_comm, pb, lay, n_dev)
    # gathers hide behind the forward, gradient reductions behind the backward that produces them;
    # what the last micro-batch leaves of its windows hides the once-per-step traffic
    grads_hide = dp_overlaps(pb)
    params_hide = grads_hide if not pb.gpu else pb.stack.param_overlap
    if grads_hide:
        dp = m * (max(0.0, mb_b - (b + w)) + mb_b / n_dev) + max(0.0, grad_c - max(0.0, b + w - mb_b)) + grad_c / n_dev
    else:
        dp = m * mb_b + grad_c
    if params_hide:
        dp += m * (max(0.0, mb_f - f) + mb_f / n_dev) + max(0.0, param_c - max(0.0, f - mb_f)) + param_c / n_dev
    else:
        dp += m * mb_f + param_c
    contention = pb.k["contention"] * max(0.0, m * (mb_f + mb_b) + grad_c + param_c - dp) if pb.gpu else 0.0

    dense, expert = device_params(pb.shape, lay, n_dev, True, p == 1)
    local = dense / (lay.shard_degree if lay.effective_zero else 1) + \
        expert / (lay.expert_shard_degree if lay.effective_zero else 1)
    optimizer = local * pb.hw.optimizer_s_per_param or OPTIMIZER_BYTES_PER_PARAM * local / pb.hw.hbm_bw

    copies = fsdp_copy_seconds(pb, lay, dense + expert, m, n_dev)
    busy = m * dev + copies
    head_here = p == 1 or split.last_work * per_layer + lc["head"] >= split.first_work * per_layer
    tp_fixed = m * tp_head(pb, lay) if head_here else 0.0  # in lc["head"], so in busy: move it to comm
    # Layer communication on the critical device: its layers' share (the head has none)
    comm = {x: m * (dev - lc["head"] * head_here) / per_layer * lc[x] for x in ("tp", "cp", "ep")}
    comm["tp"] += tp_fixed
    inner = sum(comm.values())
    compute, recompute = busy - inner + contention, m * scale * lc["recompute"]
    total = busy + bubble + pp + dp + optimizer + contention
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
