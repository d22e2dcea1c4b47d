"""Memory terms the dry run (tools/dryrun) measured on ndtrain's runtime and the planner now
prices as the runtime holds them (docs/dryrun.md, "How the two sides file the same bytes"; the
fixes in docs/results/dryrun.md)."""

import pytest

from ndtrain.layout import Layout
from ndtrain.model.config import preset
from ndtrain.planner.memory import activation_bytes, device_params, memory_breakdown
from ndtrain.planner.problem import make_problem, stage_split
from ndtrain.planner.shapes import shape_of
from ndtrain.planner.stack import STACKS


def test_a_pipeline_stage_holds_its_whole_gradients_in_the_reduce_dtype():
    """FSDP2 accumulates a pipeline stage's gradients unsharded in fp32 (its reduce dtype) until
    the step's one reduce-scatter; a stack accumulating in bf16 holds 2 bytes."""
    cfg = preset("llama3-405b", n_layers=16)
    lay = Layout(pp=8, dp_shard=8, tp=8, zero=3, micro_batch=1, activation_checkpoint="selective", pp_schedule="1F1B")
    for stack, nbytes in (("ndtrain", 4), ("megatron-core-2024", 2)):
        pb = make_problem(cfg, 8192, 128, 512, "h100", stack=stack)
        split = stage_split(pb, lay)
        mem = memory_breakdown(pb, lay, split)
        assert mem["device"] == "first"  # 1F1B: p micro-batches in flight there
        dense, expert = device_params(pb.shape, lay, split.first, True, False)
        assert mem["grads"] == pytest.approx(nbytes * (dense + expert))


def test_selective_under_tp_and_sp_keeps_the_sharded_block_input_and_reduce_scatters():
    """ndtrain's policy under TP + SP: the block input and the two reduce-scatter outputs (6/t) plus
    Q, K, V, the attention output and w1, w3 (S/t); a row-parallel matmul's partial sums are
    recomputed."""
    sh = shape_of(preset("llama3-70b"))
    s, b, t = 8192, 1, 8
    sbh = s * b * sh.dim
    S = 4 + 4 * sh.gqa_ratio + 4 * sh.mlp_act_width / sh.dim
    lse = 4 * sh.heads * s * b / t
    got = activation_bytes(sh, STACKS["ndtrain"], s, b, t, True, 1, "selective", 2)
    assert got == pytest.approx(sbh * (6 + S) / t + lse)


def test_fsdp_files_the_fp32_master_as_the_parameter():
    """FSDP2's mixed precision keeps the fp32 shard as the parameter and fp32 gradients (4 + 4 + 8
    a parameter under ZeRO-3, as the dry run counts them); a stack with a bf16 model and the
    master in the optimizer files 2 + 2 + 12. The same 16 bytes either way."""
    cfg = preset("llama3-8b")
    lay = Layout(dp_shard=8, zero=3, micro_batch=1, activation_checkpoint="selective")
    got = {}
    for stack in ("ndtrain", "megatron-core-2024"):
        pb = make_problem(cfg, 8192, 32, 8, "h100", stack=stack)
        mem = memory_breakdown(pb, lay, stage_split(pb, lay))
        got[stack] = mem
        psi = mem["params"] + mem["grads"] + mem["optimizer"]
        split = (4, 4, 8) if stack == "ndtrain" else (2, 2, 12)
        assert [mem[k] / psi for k in ("params", "grads", "optimizer")] == pytest.approx([b / 16 for b in split])
    assert sum(got["ndtrain"][k] for k in ("params", "grads", "optimizer")) == pytest.approx(
        sum(got["megatron-core-2024"][k] for k in ("params", "grads", "optimizer")))


def test_zero3_buffers_at_the_loss_hold_the_root_and_the_last_block():
    """ndtrain keeps the root group (embedding, final norm, head) gathered all step; at the loss's
    backward, its peak with a 128K vocabulary, the last block is the only one gathered beside it
    (the dry run of llama3-8b on 8: 2.36 GiB). A head-less pipeline stage peaks inside its blocks:
    two gathered blocks and one block's fp32 gradients beside its root (the embedding)."""
    from ndtrain.planner.memory import root_params

    cfg = preset("llama3-8b")
    pb = make_problem(cfg, 8192, 32, 8, "h100")
    lay = Layout(dp_shard=8, zero=3, micro_batch=1, activation_checkpoint="selective")
    mem = memory_breakdown(pb, lay, stage_split(pb, lay))
    layer = pb.shape.dense_params_layer
    assert mem["buffers"] == pytest.approx(2 * (root_params(pb.shape, lay, True, True) + layer))
    pp = Layout(pp=2, dp_shard=4, zero=3, micro_batch=1, activation_checkpoint="selective", pp_schedule="1F1B")
    mem = memory_breakdown(pb, pp, stage_split(pb, pp))
    if mem["device"] == "first":
        assert mem["buffers"] == pytest.approx(2 * root_params(pb.shape, pp, True, False) + layer * (2 * 2 + 4))


def test_eager_loss_holds_what_the_dry_run_holds_at_its_backward():
    """Eager PyTorch cross-entropy (fp32 logits): the log-softmax kept and two fp32 gradients at
    its backward, 12 bytes a logit; under TP torch's loss_parallel adds the exp of the shifted
    logits, 16 (the dry runs of llama3-8b cp 8 and llama3-70b tp 8 hold exactly these)."""
    cfg = preset("llama3-8b")
    pb = make_problem(cfg, 8192, 64, 8, "h100")
    for lay, nbytes in ((Layout(dp_shard=8, zero=3, micro_batch=1, activation_checkpoint="selective"), 12),
                        (Layout(dp_shard=4, tp=2, zero=3, micro_batch=1, activation_checkpoint="selective"), 16)):
        mem = memory_breakdown(pb, lay, stage_split(pb, lay))
        assert mem["logits"] == pytest.approx(nbytes * 8192 * pb.shape.vocab / lay.tp)


def test_a_shallow_short_sequence_rank_peaks_at_the_roots_reduce():
    """llama3-8b at 2 layers and 1,024 tokens: the dry run peaks when the root group (embedding and
    head, 1.05 B parameters) is reduced, gathered in bf16 beside its fp32 gradients (5.87 GiB of
    buffers, no activation left)."""
    from ndtrain.planner.memory import root_params

    pb = make_problem(preset("llama3-8b", n_layers=2), 1024, 32, 8, "h100")
    lay = Layout(dp_shard=8, zero=3, micro_batch=1, activation_checkpoint="selective")
    mem = memory_breakdown(pb, lay, stage_split(pb, lay))
    root = root_params(pb.shape, lay, True, True)
    assert mem["activations"] == mem["logits"] == 0
    assert mem["buffers"] == pytest.approx(root * (2 + 4))
