"""Memory per device: model states under DDP/ZeRO/HSDP, activations (Korthikanti et al. 2022,
adapted to SwiGLU/GQA/RMSNorm), micro-batches in flight per pipeline schedule, logits, buffers.

Activation accounting, in units of s*b*h bytes at 2-byte activations (s = local sequence, b =
micro-batch, h = hidden, a = heads, g = kv heads, w = MLP intermediate width, t = tp):

  replicated over TP unless sequence-parallel, R:
      2 norm inputs + 2 norm outputs = 8, plus 2 one-byte dropout masks = 10 for GPT
  sharded over TP, S:
      Q 2 + K,V 4g/a + attention output 2 + MLP
      MLP: GeLU stores its input and output, 4w/h (= 16 for w = 4h);
           SwiGLU stores gate, up, silu(gate) and their product, 8w/h
      MoE layers add 4k: the k routed copies of each token in and out of the experts
  scores: 5as/h (softmax 2 + dropout mask 1 + dropout output 2) for unfused attention,
      2as/h without dropout, none with flash attention (it recomputes them in backward)

GPT (g = a, w = 4h, dropout, unfused) gives R + S = 10 + 24 = 34: Korthikanti's sbh(34 + 5as/h).
Llama 3 8B (g/a = 1/4, w = 3.5h, no dropout, flash) gives 8 + (5 + 28) = 41 sbh and no s^2 term:
SwiGLU's third matrix costs more than GeLU, GQA saves 3 sbh on K,V, dropout masks disappear.
"""

from __future__ import annotations

from functools import lru_cache

from ndtrain.layout import Layout
from ndtrain.layout import schedules as registry
from ndtrain.planner.problem import Problem, Split
from ndtrain.planner.shapes import Shape
from ndtrain.planner.stack import Stack

# Caching-allocator slack, a share of the allocations that churn every step (activations, logits,
# buffers); for GPUs the constant `fragmentation` (planner/constants.py, with its range) replaces it.
FRAGMENTATION = 0.10

# CPU ranks (Gloo). Measured per rank with benchmarks/memory_peak.py (peak resident set) and
# torch.profiler's memory events (live tensor bytes), tiny preset at 8 and 24 layers, world 2
# and 4, fp32 and bf16 (docs/results/benchmarks.md, "Peak resident memory per rank"). On this runtime
# there are no separate 25 MB buckets: fp32 DDP runs on torch's reducer with
# gradient_as_bucket_view (the buckets are the gradients, already counted), every other data
# parallel layout on FSDP2, which moves one FSDP group at a time. Its largest group is the root
# (embedding, final norm and head: fully_shard(model), reshard_after_forward=False), 4.2 M of
# tiny's 10.5 M parameters. Each of its collectives holds three whole copies of the group:
GLOO_GATHER_COPIES = 3  # all-gather: FSDP2's flat output, Gloo's own flat copy (newLikeFlat), the copy-out into the parameters
GLOO_REDUCE_COPIES = 3  # reduce-scatter: the unsharded gradients, FSDP2's flat input, the all-to-all's received buffer (gloo_reduce_scatter.py)
# The unshards run asynchronously on Gloo's worker thread (data_parallel.overlap_on_gloo), whose
# flat buffers glibc keeps in that thread's own arena after they are freed: the current and the
# prefetched group's. MALLOC_ARENA_MAX=1 removed 40 MiB of ZeRO-3's peak (tiny, world 4, fp32),
# against 34 MiB for two fp32 root groups.
GLOO_ARENA_GATHERS = 2


def activation_terms(shape: Shape, stack: Stack, ac: str, fp8: bool = False) -> tuple[float, float, float]:
    """(R, S, score coefficient) of the module docstring for one layer, after `ac` is applied;
    full recompute is handled by the caller (it keeps only the layer input). `fp8`: the stack
    keeps fp8 Linears' inputs as fp8 (the two norm outputs, a copy of the attention output, the
    MLP's last input at one byte)."""
    a, h, w = shape.heads, shape.dim, shape.mlp_act_width
    r = 8.0 + (2.0 if stack.dropout else 0.0)
    # a fused SwiGLU kernel recomputes silu(gate) in its backward: gate, up and the product stay
    mlp = (4.0 if shape.gelu else 6.0 if stack.fused_elementwise else 8.0) * w / h
    if fp8:
        r -= 2.0
        mlp -= w / h
    moe = 4.0 * shape.active_experts * shape.moe_layer_frac
    if ac == "selective" and stack.selective == "ops":
        # the layer input, the attention output, and every other matmul output (Q, K, V, the
        # attention projection, the MLP's up/gate outputs, its down projection)
        mm_out = 2.0 + 4.0 * shape.gqa_ratio + 2.0 + (2.0 if shape.gelu else 4.0) * w / h + 2.0
        return 2.0, 2.0 + mm_out / 2 + moe, 0.0
    if ac == "selective" and stack.selective in ("act", "elementwise"):
        # the activation function's output is recomputed from its stored input. ndtrain's policy
        # ("elementwise": every matmul and attention output kept, every other op recomputed)
        # keeps x, Q, K, V, the attention, wo, w1, w3 and w2 outputs: 25 sbh for Llama 3 8B
        # against this count's 27, close enough to keep one formula for both
        mlp /= 2
    s = 4.0 + 4.0 * shape.gqa_ratio + mlp + moe + (1.0 if fp8 else 0.0)
    if stack.flash_attention or ac == "selective":
        score = 0.0  # selective recompute exists to drop exactly this term
    else:
        score = (5.0 if stack.dropout else 2.0) * a
    return r, s, score


@lru_cache(maxsize=1 << 16)
def activation_bytes(shape: Shape, stack: Stack, seq: int, b: int, t: int = 1, sp: bool = False,
                     cp: int = 1, ac: str = "none", elt: int = 2, fp8: bool = False) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one device."""
    s_loc = seq / cp
    sbh = s_loc * b * shape.dim * (elt / 2)
    if ac == "full":
        return 2 * sbh / (t if sp else 1)
    r, s, score = activation_terms(shape, stack, ac, fp8)
    if ac == "selective" and stack.selective == "elementwise" and sp:
        # ndtrain's policy under TP + SP keeps, of the sequence-sharded part, the block input and
        # the two reduce-scatter outputs; the norms are recomputed, and so are a row-parallel
        # matmul's partial sums (parallel/activation.py)
        r = 6.0
    stored = sbh * (r / (t if sp else 1) + s / t)
    # scores: each device holds its s/cp queries against the full key length
    stored += score * s_loc * seq * b * (elt / 2) / t
    if stack.flash_attention:
        stored += 4 * shape.heads * s_loc * b / t  # fp32 log-sum-exp per query row and head
    return stored


def in_flight(schedule: str, p: int, v: int, m: int) -> tuple[float, float]:
    """Micro-batches whose activations a device holds at its peak (the schedule registry's rule):
    (first pipeline rank, last pipeline rank)."""
    return registry.get(schedule).in_flight(p, v, m)


def state_bytes(psi: float, zero: int, shard: int, pbytes: int, grads_sharded: bool | None = None,
                whole_grad_bytes: int = 2, master_in_params: bool = False) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes for `psi` parameters, ZeRO stage `zero` (0 = DDP)
    over `shard` ranks. Mixed-precision Adam: 2 + 2 + 12 = 16 bytes/param (fp32: 4 + 4 + 8).
    `grads_sharded` overrides whether the stage's gradients are held sharded (a pipeline reduces
    them once per step, so it holds them whole whatever the stage); a sharded stage holding them
    whole keeps them at `whole_grad_bytes` (the stack's accumulation dtype) a parameter.
    `master_in_params` (the stack's flag): the fp32 shard is the parameter and its gradient is
    fp32, 4 + 4 + 8; the whole low-precision copy a sharded stage computes with is gathered,
    a communication buffer (`gathered_copy_bytes`), not a parameter."""
    pb, gb, ob = (4, 4, 8) if pbytes == 4 or master_in_params else (2, 2, 12)
    if zero == 0 or shard <= 1:
        return pb * psi, gb * psi, ob * psi
    if grads_sharded is None:
        grads_sharded = zero >= 2
    grads = gb * psi / shard if grads_sharded else max(gb, whole_grad_bytes) * psi
    return (pb * psi / shard if zero == 3 or master_in_params else pb * psi), grads, ob * psi / shard


def gathered_copy_bytes(psi: float, shard: int, pbytes: int, master_in_params: bool) -> float:
    """Bytes a sharded stage's whole gathered copy of `psi` parameters adds beside its states:
    the whole copy where the parameters are separate fp32 shards (FSDP's), the rest of it where
    the shard is part of the copy."""
    return psi * pbytes * (1.0 if master_in_params else 1 - 1 / shard)


def device_params(shape: Shape, lay: Layout, layers: int, embed: bool, head: bool) -> tuple[float, float]:
    """(dense, routed-expert) parameters on one device holding `layers` layers. Tensor parallel
    shards attention, dense MLPs, embedding and head; MoE layers (router, shared and routed
    experts) are replicated over tp, as the runtime builds them, and routed experts split over ep."""
    t = lay.tp
    dense = layers * ((shape.dense_params_layer - shape.moe_dense_params_layer) / t + shape.moe_dense_params_layer)
    if embed:
        dense += shape.embed_params / t
    if head and (not shape.tied or not embed):
        dense += shape.embed_params / t + shape.dim
    return dense, layers * shape.expert_params_layer / lay.ep


def root_params(shape: Shape, lay: Layout, embed: bool, head: bool) -> float:
    """Parameters outside the decoder blocks on one device (embedding, final norm, head): the
    runtime's root FSDP group."""
    return device_params(shape, lay, 0, embed, head)[0]


def gloo_dp_buffers(pb: Problem, lay: Layout, embed: bool, head: bool, pbytes: int) -> float:
    """Data-parallel communication bytes a CPU rank holds beyond its model states (the constants
    above say what measured them): none on the DDP reducer or without data parallelism; on
    FSDP2, the larger of its collectives on the largest group, plus the gathers glibc retains."""
    if lay.dp * lay.cp <= 1 or lay.on_ddp_reducer(pb.cfg.is_moe, pb.precision):
        return 0.0
    sh = pb.shape
    group = max(root_params(sh, lay, embed, head), sh.dense_params_layer / lay.tp + sh.expert_params_layer / lay.ep)
    gather = GLOO_GATHER_COPIES * group * pbytes
    reduce = GLOO_REDUCE_COPIES * group * pb.stack.grad_reduce_bytes
    return max(gather, reduce) + GLOO_ARENA_GATHERS * group * pbytes


def memory_breakdown(pb: Problem, lay: Layout, split: Split) -> dict:
    """Peak bytes on the fullest device, broken down. `split`: the layers per pipeline rank
    (problem.stage_split, the runtime's partition)."""
    sh, st, elt = pb.shape, pb.stack, pb.act_bytes
    p, t, sp = lay.pp, lay.tp, lay.sequence_parallel and lay.tp > 1
    m = lay.micro_batches(pb.global_batch)
    first_inf, last_inf = in_flight(lay.pp_schedule, p, lay.pp_virtual_stages, m)
    fp8 = pb.precision == "fp8" and st.fp8_saves_fp8
    per_layer = activation_bytes(sh, st, pb.seq, lay.micro_batch, t, sp, lay.cp, lay.activation_checkpoint, elt, fp8)
    working = activation_bytes(sh, st, pb.seq, lay.micro_batch, t, sp, lay.cp, "none", elt,
                               fp8) if lay.activation_checkpoint == "full" else 0.0
    logit_elems = lay.micro_batch * pb.seq / lay.cp * sh.vocab / t
    shard = lay.shard_degree
    zero = lay.effective_zero
    exp_shard = lay.expert_shard_degree
    pbytes = 4 if pb.precision == "fp32" else 2
    grads_sharded = lay.grads_sharded_per_microbatch
    mip = st.master_in_params

    def kept_gathered(psi: float, z: int, n: int) -> float:
        """The whole copy a stage that does not reshard after its forward holds all step."""
        if z == 0 or n <= 1 or (z < 3 and not mip):  # unsharded, or the copy is the parameters
            return 0.0
        return gathered_copy_bytes(psi, n, pbytes, mip)

    if p == 1:
        devices = [("only", sh.layers, True, True, 1.0)]
    elif split.head_rank == 0:  # V schedules: the first and last stage share rank 0
        devices = [("first+last", max(split.ranks), True, True, first_inf)]
    else:
        devices = [("first", split.first, True, False, first_inf), ("last", split.last, False, True, last_inf)]

    best = None
    for name, layers, embed, head, inf in devices:
        dense, expert = device_params(sh, lay, layers, embed, head)
        exp_zero = zero if exp_shard > 1 else 0
        dp_, dg, do = state_bytes(dense, zero, shard, pbytes, grads_sharded, st.whole_grad_bytes, mip)
        ep_, eg, eo = state_bytes(expert, exp_zero, exp_shard, pbytes, grads_sharded, st.whole_grad_bytes, mip)
        acts = layers * per_layer * inf + working
        # the loss's backward follows its forward at once, except where all forwards run first
        held = m if p > 1 and registry.get(lay.pp_schedule).forwards_first else 1
        if st.loss == "flash":  # bf16 logits kept, a bf16 gradient transient (flash-attn's kernel)
            kept, transient = elt, elt
        elif st.loss == "eager":
            # PyTorch's cross-entropy on the logits cast to fp32: log-softmax keeps its fp32
            # output (nothing saves the bf16 logits or their fp32 copy); in its backward the
            # dense NLL gradient and the log-softmax gradient, both fp32, are live together.
            # Under TP, torch's loss_parallel keeps the max-shifted logits and its backward
            # computes their exp beside those two
            kept, transient = 4, (12 if t > 1 else 8)
        else:  # a fused kernel: bf16 logits and the fp32 softmax kept, an fp32 gradient transient
            kept, transient = elt + 4, 4
        logits = logit_elems * (kept * held + transient) if head else 0.0
        layer_psi = sh.dense_params_layer / t + sh.expert_params_layer / lay.ep
        if not pb.gpu:
            buckets = gloo_dp_buffers(pb, lay, embed, head, pbytes)
        elif lay.dp * lay.cp <= 1 or lay.on_ddp_reducer(pb.cfg.is_moe, pb.precision):
            buckets = 0.0  # DDP's buckets are the gradients (gradient_as_bucket_view); NCCL reduces in place
        else:
            buckets = layer_psi * st.grad_reduce_bytes  # FSDP2 reduces a block's gradients from its own buffer
        if zero == 3 and lay.reshards_after_forward:
            buffers = layer_psi * (2 * pbytes + st.grad_reduce_bytes)  # two gathered layers + one layer's grads
            if pb.gpu and st.root_kept_gathered:
                # The root group is gathered all step. At the loss's backward (its gradient
                # transient live) only the last block is gathered beside it: the next block's
                # gather and the first reduce-scatter come later, when that micro-batch's logits
                # are gone. Last, the root's own gradients are reduced, the backward's activations
                # gone: its gathered copy and its gradients in the reduce dtype. The peak is the
                # largest of the three moments.
                root_psi = root_params(sh, lay, embed, head)
                root = gathered_copy_bytes(root_psi, shard, pbytes, mip)
                at_loss = root + gathered_copy_bytes(layer_psi, shard, pbytes, mip)
                logits_after = logit_elems * kept * (held - 1) if head else 0.0
                if head and logits + at_loss > logits_after + root + buffers:
                    buffers = at_loss
                else:
                    logits, buffers = logits_after, root + buffers
                at_root_reduce = root + root_psi * st.grad_reduce_bytes
                if at_root_reduce > acts + logits + buffers:
                    acts, logits, buffers = 0.0, 0.0, at_root_reduce
            if not pb.gpu:  # the root group and the last block stay gathered from forward to backward
                buffers += gathered_copy_bytes(root_params(sh, lay, embed, head) + layer_psi, shard, pbytes, mip)
                buffers += buckets
        else:
            # kept gathered from forward to backward (ZeRO-1/2, reshard_after_forward off, or a
            # schedule with a separate weight pass): the device's whole share, unsharded
            buffers = kept_gathered(dense, zero, shard) + kept_gathered(expert, exp_zero, exp_shard) + buckets
        frag = pb.k.get("fragmentation", FRAGMENTATION) * (acts + logits + buffers)
        parts = {"params": dp_ + ep_, "grads": dg + eg, "optimizer": do + eo, "activations": acts,
                 "logits": logits, "buffers": buffers, "overhead": pb.overhead_bytes, "fragmentation": frag}
        total = sum(parts.values())
        if best is None or total > best["total"]:
            best = {**parts, "total": total, "device": name, "layers": layers}
    return best
