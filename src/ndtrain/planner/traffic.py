"""Bytes each collective moves in one training step on the device holding the first pipeline stage
(the embedding), by collective and mesh dimension, from the counts the step-time model prices
(planner/layer.py, planner/timing.py): so that `ndtrain dryrun` can put them beside what the real
step issued (tools/dryrun_watch counts the same way).

Conventions, as planner/comm.py's and the dry run's: an all-reduce counts its buffer, an all-gather
its gathered output, a reduce-scatter its input, an all-to-all and a send what this rank sends.

Counted: tensor parallel's per-layer pairs (two all-reduces per pass over a layer, or with sequence
parallel the all-gather and reduce-scatter each stands for) and the embedding's and the head's; context parallel's ring of K/V hops (3 per peer per
layer: forward, and K/V with their gradients in the backward) or its all-gather and reduce-scatter;
expert parallel's dispatch and combine; pipeline sends and receives; data-parallel gathers,
reduce-scatters and all-reduces per ZeRO stage. Left out: the few-byte all-reduces (loss, norms,
the vocab-parallel loss's statistics).

Where the runtime differs from what the time model prices, this counts the runtime: the ring's
K/V gradients travel one hop more than the K/V (home to their owner) and in fp32; selective
checkpointing recomputes tensor parallel's gathers, the ring's attention and the experts'
dispatch (the time model counts none of them); FSDP2 keeps the root and the last block gathered
from the forward to the backward, and a pipeline's schedule keeps a stage's parameters gathered
between its backwards (gathers_per_step, which the step-time
model prices too)."""

from __future__ import annotations

from ndtrain.layout import Layout
from ndtrain.planner.memory import device_params, root_params
from ndtrain.planner.problem import Problem


def _add(out: dict, kind: str, dim: str, nbytes: float) -> None:
    if nbytes > 0:
        cell = out.setdefault(kind, {})
        cell[dim] = cell.get(dim, 0.0) + nbytes


def collective_bytes(pb: Problem, lay: Layout, layers: int) -> dict[str, dict[str, float]]:
    """{collective: {mesh dimension: bytes per step}} on the first stage's device holding `layers`
    decoder layers (all of them without pipeline parallelism)."""
    sh, elt = pb.shape, pb.act_bytes
    t, c, ep = lay.tp, lay.cp, lay.ep
    m = lay.micro_batches(pb.global_batch)
    tok = lay.micro_batch * pb.seq / c  # tokens of one micro-batch a tp group works on
    passes = 3 if lay.activation_checkpoint == "full" else 2  # forward, backward, and the forward again under full AC
    # Selective checkpointing keeps matmul outputs, not their gathered inputs or the ring's
    # attention: its recompute gathers again (parallel/activation.py's policy)
    regathers = 3 if lay.activation_checkpoint in ("full", "selective") else 2
    head_here = lay.pp == 1
    out: dict[str, dict[str, float]] = {}

    if t > 1:
        act = tok * sh.dim * elt
        per_layer = 2 * passes * act * layers * m
        # The embedding's output (scattered over the sequence, or all-reduced) and, where the head
        # is, its input's gradient (reduce-scattered, or all-reduced) and its gathered input
        ends = act * m * (1 + head_here)
        if lay.sequence_parallel:  # each all-reduce is a reduce-scatter and an all-gather of the same buffer
            _add(out, "all_gather", "tp", 2 * regathers * act * layers * m + ends)
            _add(out, "reduce_scatter", "tp", per_layer + ends)
        else:
            _add(out, "all_reduce", "tp", per_layer + ends)

    if c > 1:
        kv = 2 * tok * sh.dim * sh.gqa_ratio * elt / min(t, sh.kv_heads)
        if lay.cp_attention == "ring":
            # K/V around the ring in the forward, its recompute and the backward; dK/dV, summed
            # in fp32, around it and home to their owner
            sent = ((c - 1) * regathers * kv + c * kv * 4 / elt) * layers * m
            _add(out, "send", "cp", sent)
            _add(out, "recv", "cp", sent)
        else:
            _add(out, "all_gather", "cp", (passes * kv * c) * layers * m)
            _add(out, "reduce_scatter", "cp", kv * c * layers * m)

    if ep > 1 and sh.moe_layer_frac:
        sent = tok * sh.active_experts * sh.dim * elt / t * pb.k["moe_imbalance"]
        _add(out, "all_to_all", "ep", sent * (2 * regathers) * sh.moe_layer_frac * layers * m)

    if lay.pp > 1:
        msg = tok * sh.dim * elt / t  # scattered over tp, as timing.py prices it
        _add(out, "send", "pp", msg * m)  # activations forward
        _add(out, "recv", "pp", msg * m)  # their gradients back

    _data_parallel(pb, lay, layers, m, out)
    return out


def _data_parallel(pb: Problem, lay: Layout, layers: int, m: int, out: dict) -> None:
    dense, expert = device_params(pb.shape, lay, layers, True, lay.pp == 1)
    pbytes = 4 if pb.precision == "fp32" else 2
    gbytes = 4 if pb.precision == "fp32" else pb.stack.grad_reduce_bytes
    zero, S, R = lay.effective_zero, lay.shard_degree, lay.dp_replicate
    shard_dim = "dp_shard_cp" if lay.cp > 1 else "dp_shard"
    if zero == 0:
        if R * lay.cp > 1:
            _add(out, "all_reduce", "dp_replicate" if lay.cp == 1 else "dp_cp", gbytes * (dense + expert))
        return
    se = max(1, S // lay.ep)
    per_mb = lay.grads_sharded_per_microbatch
    # ZeRO-3 gathers every unit for each micro-batch's forward and, where it reshards after the
    # forward, every block but the last again for its backward (the root, with the embedding and
    # head, and the last block stay gathered: parallel/data_parallel.py); ZeRO-1/2 gather once a
    # step. Gradients reduce per micro-batch where they are sharded so, else once.
    root = root_params(pb.shape, lay, True, lay.pp == 1)
    block_gathers, root_gathers = gathers_per_step(lay, m, layers)
    reduces = m if per_mb else 1
    if S > 1:
        blocks = (dense - root) / max(1, layers)
        _add(out, "all_gather", shard_dim, pbytes * (root_gathers * root + block_gathers * blocks))
        _add(out, "reduce_scatter", shard_dim, reduces * gbytes * dense)
    if se > 1 and expert:
        expert_dim = "ep_shard" if lay.ep > 1 else shard_dim
        _add(out, "all_gather", expert_dim, pbytes * block_gathers * expert / max(1, layers))
        _add(out, "reduce_scatter", expert_dim, reduces * gbytes * expert)
    if R > 1:
        _add(out, "all_reduce", "dp_replicate", gbytes * (dense / S + expert / se))


def gathers_per_step(lay: Layout, m: int, layers: int) -> tuple[float, float]:
    """(whole-block gathers summed over the device's `layers` blocks, gathers of the root) a step.

    ZeRO-1/2: once a step. ZeRO-3: every unit for each micro-batch's forward and, where blocks
    reshard after the forward, every block but the last again for its backward (the root and the
    last block stay gathered, parallel/data_parallel.py). Inside a plain pipeline schedule (one
    stage a device) torch keeps a stage's parameters gathered after a backward until the last
    (set_reshard_after_backward(False)): measured on the dry run (1F1B, pp 2 and 8, m 4-16, 2-4
    blocks a stage), each block but the last is gathered m + 2 times a step, the last block and the
    root twice. Interleaved and zero-bubble schedules are counted as without a pipeline."""
    if lay.effective_zero != 3:
        return float(layers), 1.0
    if not lay.reshards_after_forward:
        return float(m * layers), float(m)
    if lay.pp > 1 and lay.pp_virtual_stages == 1:
        return float((layers - 1) * (m + 2) + 2), 2.0
    return float(m * (2 * layers - 1)), float(m)


def whole_gathers(pb: Problem, lay: Layout, layers: int) -> float:
    """gathers_per_step in whole gathers of the device's parameters (root and blocks)."""
    dense, _ = device_params(pb.shape, lay, layers, True, lay.pp == 1)
    root = root_params(pb.shape, lay, True, lay.pp == 1)
    blocks, roots = gathers_per_step(lay, lay.micro_batches(pb.global_batch), layers)
    return (roots * root + blocks * (dense - root) / max(1, layers)) / dense if dense else 0.0
