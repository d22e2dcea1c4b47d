"""One decoder layer per micro-batch on one device: its F (forward), B (backward to the input) and
W (backward to the weights) seconds, the split the zero-bubble schedules are defined on, with the
communication inside the layer and what of it the stack hides.

On a GPU (the mechanistic model):
  GEMMs        shape by shape (planner/gemm.py): tile/wave quantization, short inner dimensions,
               the HBM roof, fp8 at its own ceiling for the Linears that run in fp8
  attention    flash: the causal half at `attn_eff`; unfused (2021): batched GEMMs over s x s
  elementwise  kappa x (activation bytes) / HBM bandwidth over F+B (eager or fused kernels, by the
               stack or the layout's `compile`), plus fp8 scaling/cast traffic
  TP           2 collectives of the layer's activation per pass; a stack with TP overlap hides them
               behind `overlap_eff` of the GEMMs of that pass
  CP           ring: each K/V hop behind the attention block it feeds (stacks with the ring
               overlap), else an all-gather of K/V forward and a reduce-scatter of dK/dV backward
  EP           dispatch + combine all-to-all forward and backward, scaled by the load imbalance;
               hidden behind the paired micro-batch only where the stack overlaps it (DualPipe)
Hidden traffic still costs `contention` of its time as extra compute (NCCL kernels take SMs).

CPU ranks ("this-machine") keep the calibrated model (`cpu_layer_costs`, unchanged).
"""

from __future__ import annotations

from ndtrain.layout import Layout
from ndtrain.layout.flops import average_layer_forward_flops, head_forward_flops
from ndtrain.layout.fp8 import fp8_matmul_fraction
from ndtrain.planner.comm import collective_time as coll
from ndtrain.planner.gemm import attention_seconds, head_seconds, layer_matmuls
from ndtrain.planner.memory import activation_bytes
from ndtrain.planner.problem import Problem

# CPU ranks: eager forward ops per decoder layer and for head + loss (Hardware.op_overhead_s is
# the host time of one such op plus its backward).
OPS_PER_LAYER = 32
OPS_HEAD = 8
# GPUs: kernels one decoder layer's forward launches. Eager (counted on model/llama.py's block):
# two RMSNorms of ~8 ops each, 7 Linears, RoPE ~6 ops each on Q and K, SDPA and its layout copies,
# SiLU and the gate product, two residual adds, casts and FSDP's per-unit hooks: ~50. Fused
# kernels (TE, torch.compile): norm, RoPE and activation each one kernel around the same GEMMs: ~20.
OPS_EAGER = 50
OPS_FUSED = 20
# Bytes of HBM traffic per logit element for loss + its gradient. Eager PyTorch cross-entropy over
# bf16 logits: the fp32 upcast (read 2, write 4), log_softmax (read 4 twice, write 4), the NLL
# backward's dense zeros (4), log_softmax's backward (read 4 + 4, write 4) and the bf16 downcast
# of the gradient (read 4, write 2): 40. A fused vocab-parallel kernel (Megatron-Core, TE, Llama 3's
# and DeepSeek's fused stacks) reads the logits twice and writes the gradient in place: ~20.
# flash-attn's bf16 cross-entropy (LLM Foundry's default loss_fn) reads the bf16 logits once forward
# and once backward and writes a bf16 gradient: ~8 (flash_attn/losses/cross_entropy.py).
LOSS_BYTES_EAGER = 40
LOSS_BYTES_FUSED = 20
LOSS_BYTES = {"eager": LOSS_BYTES_EAGER, "fused": LOSS_BYTES_FUSED, "flash": 8}


def layer_costs(pb: Problem, lay: Layout) -> dict:
    """Seconds per layer per micro-batch on one device (an average layer for MoE models)."""
    if not pb.gpu:
        return cpu_layer_costs(pb, lay)
    sh, hw, st, k, elt = pb.shape, pb.hw, pb.stack, pb.k, pb.act_bytes
    t, c, b = lay.tp, lay.cp, lay.micro_batch
    sp = lay.sequence_parallel and t > 1
    tok = b * pb.seq / c
    mm = _average_matmuls(pb, lay)
    attn = attention_seconds(pb, lay)
    kappa = k["kappa_fused"] if st.fused_elementwise or lay.compile else k["kappa_eager"]
    a_none = activation_bytes(sh, st, pb.seq, b, t, sp, c, "none", elt)
    elem = kappa * a_none / hw.hbm_bw
    cast_f = cast_b = 0.0
    if mm["cast_f"] or mm["cast_b"]:  # fp8 scaling and casts, only where a Linear runs in fp8
        cast_f, cast_b = (k["fp8_cast_bytes"] * mm[x] / hw.hbm_bw for x in ("cast_f", "cast_b"))
    fwd = mm["F"] + attn + elem / 3 + cast_f
    # A flash backward recomputes QK^T and the probabilities from the saved log-sum-exp: 5 matmuls
    # to the forward's 2, i.e. 2.5x its FLOPs (FlashAttention-2, section 3.1.2; flash-attn's
    # benchmarks count it so, and `attn_eff` comes from them); unfused kernels run 2x (4 GEMMs).
    attn_b = (2.5 if st.flash_attention else 2.0) * attn
    bwd = mm["dgrad"] + attn_b + 2 * elem / 3 + cast_b
    merge_f = merge_b = 0.0
    if c > 1 and st.cp_overlap and lay.cp_attention == "ring":  # the ring form (as the CP traffic below)
        # Each of the cp - 1 later ring steps rescales and merges the running output with the
        # new block's (online softmax: read and write the fp32 output and log-sum-exp, 12 bytes
        # per local query element) and, backward, accumulates dQ in fp32 and dK/dV for the hop
        # (16 bytes): HBM traffic beside the block kernels (parallel/ring_attention.py; the same
        # rule in Megatron-Core's and TE's CP). The all-gather form runs one kernel: no merge.
        q_elems = tok * sh.heads * sh.head_dim / t
        merge_f, merge_b = ((c - 1) * nb * q_elems / hw.hbm_bw for nb in (12, 16))
    fwd += merge_f
    bwd += merge_b
    rec = 0.0
    if lay.activation_checkpoint == "full":
        rec = fwd
    elif lay.activation_checkpoint == "selective":
        if st.selective in ("elementwise", "ops"):
            # SAC policies that keep matmul (and attention) outputs only recompute every other
            # forward op: the layer's whole forward elementwise work (and fp8's casts)
            rec = elem / 3 + cast_f
            if st.selective == "ops":
                rec += mm["F"] / 2  # half the forward matmuls run again
        else:
            a_sel = activation_bytes(sh, st, pb.seq, b, t, sp, c, "selective", elt)
            rec = kappa * (a_none - a_sel) / hw.hbm_bw / 3 + (0.0 if st.flash_attention else attn)
    n_rec = 1 if lay.activation_checkpoint == "full" else 0
    comm_f = comm_b = hidden = 0.0
    tp = cp = ep = 0.0
    if t > 1:  # 2 all-reduces (or all-gather + reduce-scatter pairs with SP) per pass
        two = 2 * coll(hw, "all_reduce", t, 1, tok * sh.dim * elt, k)
        shown = []
        for window in (mm["F"], mm["dgrad"] + mm["wgrad"], mm["F"]):  # forward, backward, recomputed forward
            shown.append(max(0.0, two - k["overlap_eff"] * window) if st.tp_overlap else two)
        shown[2] *= n_rec
        hidden += (2 + n_rec) * two - sum(shown)
        tp = sum(shown)
        comm_f += shown[0]
        comm_b += shown[1] + shown[2]
    if c > 1:
        kv = 2 * tok * sh.dim * sh.gqa_ratio * elt / min(t, sh.kv_heads)
        if st.cp_overlap and lay.cp_attention == "ring":
            hop = coll(hw, "p2p", c, t, kv, k)
            blk = attn / c
            f_exp = (c - 1) * max(0.0, hop - blk)
            b_exp = (c - 1) * max(0.0, 2 * hop - attn_b / c)  # K/V and their gradients travel back
            hidden += (c - 1) * 3 * hop - f_exp - b_exp
        else:  # K/V gathered before attention, their gradients reduce-scattered after
            f_exp = coll(hw, "all_gather", c, t, kv * c, k)
            b_exp = f_exp + coll(hw, "reduce_scatter", c, t, kv * c, k)
        cp = f_exp * (1 + n_rec) + b_exp
        comm_f += f_exp
        comm_b += b_exp + f_exp * n_rec
    if lay.ep > 1 and sh.moe_layer_frac:
        wire = 1.5 if pb.precision == "fp8" else elt  # fp8 dispatch, bf16 combine
        copies = sh.active_experts
        if st.ep_node_limit and lay.ep * t > hw.gpus_per_node:
            copies = min(copies, st.ep_node_limit)  # one copy per node crosses the NICs
        nbytes = tok * copies * sh.dim * wire / t * k["moe_imbalance"]
        total = coll(hw, "all_to_all", lay.ep, t, nbytes, k) * sh.moe_layer_frac * (4 + 2 * n_rec)
        if st.ep_overlap and lay.pairs_forward_backward:
            shown = max(0.0, total - k["overlap_eff"] * (fwd + bwd + mm["wgrad"] + rec))
            hidden += total - shown
            total = shown
        ep = total
        comm_f += total / 2
        comm_b += total / 2
    extra = k["contention"] * hidden  # hidden traffic slows the compute it hides behind
    f_dev, b_dev, w_dev = fwd + comm_f + extra / 3, bwd + rec + comm_b + extra / 3, mm["wgrad"] + extra / 3
    # The host issues every kernel: a pass whose kernels are shorter than their launches waits for
    # its host (small layers, small local batches). Eager ops count OPS_EAGER per forward, fused
    # stacks and compiled blocks OPS_FUSED; a backward launches about twice its forward's.
    ops = OPS_FUSED if st.fused_elementwise or lay.compile else OPS_EAGER
    host_f = ops * k["launch_s"]
    recompute = {"full": 1, "selective": 0.5}.get(lay.activation_checkpoint, 0)
    host_b = (2 + recompute) * host_f
    launch = max(0.0, host_f - f_dev) + max(0.0, host_b - (b_dev + w_dev))
    f_dev, b_dev = max(f_dev, host_f), b_dev + max(0.0, host_b - (b_dev + w_dev))
    return {"F": f_dev, "B": b_dev, "W": w_dev,
            "compute": fwd + bwd + mm["wgrad"] + rec + extra + launch, "recompute": rec, "tp": tp, "cp": cp,
            "ep": ep, "launch": launch, "cp_merge": merge_f + merge_b, "head": head_cost(pb, lay)}


def _average_matmuls(pb: Problem, lay: Layout) -> dict:
    """layer_matmuls averaged over the model's layers (dense and MoE layers weighted by count)."""
    cfg = pb.cfg
    kinds: dict[bool, list[int]] = {}
    for i in range(cfg.n_layers):
        kinds.setdefault(cfg.is_moe_layer(i), []).append(i)
    out: dict = {}
    for layers in kinds.values():
        share = len(layers) / cfg.n_layers
        for key, val in layer_matmuls(pb, lay, layers[0]).items():
            out[key] = out.get(key, 0.0) + share * val
    return out


def head_cost(pb: Problem, lay: Layout) -> float:
    """Output layer + loss per micro-batch, forward and backward (never recomputed)."""
    if not pb.gpu:
        return cpu_head_cost(pb, lay)
    tok = lay.micro_batch * pb.seq / lay.cp
    # The loss over the vocabulary (128K for Llama 3: 2 x 10^9 logits per 16K tokens): its softmax
    # traffic through HBM by the stack's loss kernel (LOSS_BYTES), beside the head GEMMs priced by shape.
    per_elem = LOSS_BYTES[pb.stack.loss]
    loss = per_elem * tok * pb.shape.vocab / lay.tp / pb.hw.hbm_bw
    return head_seconds(pb, lay) + loss


# ---- CPU ranks ("this-machine"): the calibrated model ----------------------------------------


def cpu_layer_costs(pb: Problem, lay: Layout) -> dict:
    sh, hw, st, elt = pb.shape, pb.hw, pb.stack, pb.act_bytes
    t, c, b = lay.tp, lay.cp, lay.micro_batch
    sp = lay.sequence_parallel and t > 1
    tok = b * pb.seq / c
    mm_flops, attn_flops = average_layer_forward_flops(pb.cfg, pb.seq, "causal" if st.flash_attention else "full")
    eff = hw.cpu_mm_eff(pb.precision)
    rate = hw.peak(pb.precision) * eff
    if pb.precision == "fp8":
        f = fp8_matmul_fraction(pb.cfg, t)
        rate = eff / (f / hw.peak("fp8") + (1 - f) / hw.peak("bf16"))
    # MoE layers run replicated over tp (each tp rank routes the whole sequence)
    moe = sh.mm_moe_layer / sh.mm_params_layer if sh.mm_params_layer else 0.0
    mm = tok * mm_flops * ((1 - moe) / t + moe) / rate
    attn = tok * attn_flops / t / hw.attention_rate("bf16" if pb.precision == "fp8" else pb.precision, pb.seq)
    a_none = activation_bytes(sh, st, pb.seq, b, t, sp, c, "none", elt)
    elem = hw.kappa * a_none / hw.hbm_bw + (hw.layer_overhead_s or OPS_PER_LAYER * hw.op_overhead_s)
    if lay.compile:
        # Compiled blocks, priced by what they measured against eager on CPU ranks (a whole-layer
        # fraction: fused elementwise ops, fewer host calls, inductor's own GEMM calls).
        keep = 1.0 - hw.cpu_compile_saving.get("bf16" if pb.precision == "fp8" else pb.precision, 0.0)
        mm, attn, elem = mm * keep, attn * keep, elem * keep
    fwd = mm + attn + elem / 3
    rec = 0.0
    if lay.activation_checkpoint == "full":
        rec = fwd
    elif lay.activation_checkpoint == "selective":
        a_sel = activation_bytes(sh, st, pb.seq, b, t, sp, c, "selective", elt)
        rec = hw.kappa * (a_none - a_sel) / hw.hbm_bw / 3 + (0.0 if st.flash_attention else attn)
    comm_f = comm_b = tp = cp = ep = 0.0
    n_rec = 1 if lay.activation_checkpoint == "full" else 0
    if t > 1:
        ar = tp_all_reduce(pb, t, tok * sh.dim * elt)
        tp = ar * (4 + 2 * n_rec)
        comm_f += 2 * ar
        comm_b += 2 * ar * (1 + n_rec)
    if c > 1:
        kv = 2 * tok * sh.dim * sh.gqa_ratio * elt / min(t, sh.kv_heads)
        hop = coll(hw, "p2p", c, t, kv)
        blk = attn / c
        f_exp = (c - 1) * max(0.0, hop - blk)
        b_exp = (c - 1) * max(0.0, 2 * hop - 2 * blk)
        cp = f_exp * (1 + n_rec) + b_exp
        comm_f += f_exp
        comm_b += b_exp + f_exp * n_rec
    if lay.ep > 1 and sh.moe_layer_frac:
        a2a = coll(hw, "all_to_all", lay.ep, t, tok * sh.active_experts * sh.dim * elt / t) * sh.moe_layer_frac
        ep = a2a * (4 + 2 * n_rec)
        comm_f += ep / 2
        comm_b += ep / 2
    return {"F": fwd + comm_f, "B": mm + 2 * attn + 2 * elem / 3 + rec + comm_b, "W": mm,
            "compute": 3 * mm + 3 * attn + elem + rec, "recompute": rec, "tp": tp, "cp": cp, "ep": ep,
            "head": cpu_head_cost(pb, lay)}


def tp_all_reduce(pb: Problem, t: int, nbytes: float) -> float:
    """CPU ranks: a quarter of what calibration measured a TP layer to cost beyond its share of
    compute (DTensor dispatch and Gloo latency dominate there); the alpha-beta collective where
    nothing was measured."""
    measured = pb.hw.tp_cost(pb.world, t, "layer", nbytes)
    return coll(pb.hw, "all_reduce", t, 1, nbytes) if measured is None else measured / 4


def tp_head(pb: Problem, lay: Layout) -> float:
    """CPU ranks: what embedding, head and vocab-parallel loss cost a TP micro-batch beyond its
    share of compute, where measured; 0 elsewhere."""
    if lay.tp == 1 or pb.gpu:
        return 0.0
    nbytes = lay.micro_batch * pb.seq / lay.cp * pb.shape.dim * pb.act_bytes
    return pb.hw.tp_cost(pb.world, lay.tp, "head", nbytes) or 0.0


def cpu_head_cost(pb: Problem, lay: Layout) -> float:
    sh, hw, elt = pb.shape, pb.hw, pb.act_bytes
    tok = lay.micro_batch * pb.seq / lay.cp
    head_precision = "bf16" if pb.precision == "fp8" else pb.precision
    gemm = 3 * tok * head_forward_flops(pb.cfg) / lay.tp / (hw.peak(head_precision) * hw.cpu_mm_eff(head_precision))
    loss = 2 * (elt + 8) * tok * sh.vocab / lay.tp / hw.hbm_bw
    return gemm + loss + (hw.head_overhead_s or OPS_HEAD * hw.op_overhead_s) + tp_head(pb, lay)
