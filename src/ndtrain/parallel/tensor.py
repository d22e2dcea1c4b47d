"""Tensor parallel (Megatron column/row split) with optional sequence parallel, via DTensor.

Attention: q/k/v column-parallel (heads, and therefore kv-heads, split across tp), o row-parallel.
MLP: w1/w3 column-parallel, w2 row-parallel. Embedding is row-parallel over the vocabulary; the
head is column-parallel and its logits stay vocab-sharded for `loss_parallel`, so the full
[tokens, vocab] logits never exist on one rank.

With sequence parallel the residual stream and norms are sharded along the sequence between the
TP regions, turning each all-reduce into a reduce-scatter + all-gather pair of the same volume
but 1/tp of the activation memory.

The blocks compile (`[parallel] compile`) under TP because the first one is handed a plain
tensor: see `_wait_embedding_output`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ndtrain.compat.torch import async_collective_tensor


class _Wait(torch.autograd.Function):
    """Identity that waits for an async collective's result: a plain tensor forward, the gradient
    passed straight back."""

    @staticmethod
    def forward(ctx, x) -> torch.Tensor:  # an AsyncCollectiveTensor
        out = x.trigger_wait()
        return out.view_as(out)  # a fresh alias: autograd's metadata must not land on the ACT's own tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_embedding_output(module: nn.Module, args, out):
    """RowwiseParallel reduces the embedding's partial sums with `async_op=True` and `to_local()`
    hands the first block an AsyncCollectiveTensor (ACT). A compiled block loses the gradient of
    an ACT input in torch 2.13: AOTAutograd traces it as its waited inner tensor, which has no
    autograd state (torch/_functorch/_aot_autograd/frontend_utils.py, process_inputs), so the
    backward returns None and the embedding's Redistribute backward fails on a plain tensor
    (AttributeError '_local_tensor'). Waiting here costs no overlap: the first block's norm reads
    the tensor at once. tests/parallel/test_tp_compile.py flags the day torch fixes it."""
    act = async_collective_tensor()  # private torch (compat.torch); without it there is nothing to wait for
    return _Wait.apply(out) if act is not None and isinstance(out, act) else out


class VocabParallelEmbedding(nn.Embedding):
    """The embedding split over tp by vocabulary rows (a Shard(0) DTensor weight, as
    RowwiseParallel makes it): each rank looks up the tokens in its rows, zeros the others, and
    the partial sums are reduced to the output layout. RowwiseParallel's DTensor embedding has
    no row-sharded backward in torch 2.13 (embedding_dense_backward's strategies give the weight
    gradient replicated or partial), so every tp rank built the gradient of the whole vocabulary
    and its fp32 copy: llama3-405b, tp 8, 11.7 GiB on the first pipeline stage (tools/dryrun).
    Here the backward is the local rows' only. Turned into from an nn.Embedding by
    `vocab_parallel`."""

    tp_mesh = None
    output_layout = Replicate()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()
        rows = local.shape[0]
        # Shard(0) splits like torch.chunk: ceil(vocab / tp) rows a rank, the last one's fewer
        start = self.tp_mesh.get_local_rank() * -(-self.num_embeddings // self.tp_mesh.size())
        index = tokens - start
        outside = (index < 0) | (index >= rows)
        out = F.embedding(index.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(out, self.tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(self.tp_mesh, [self.output_layout]).to_local()


def vocab_parallel(emb: nn.Embedding, tp_mesh, output_layout) -> None:
    emb.register_parameter("weight", nn.Parameter(distribute_tensor(emb.weight, tp_mesh, [Shard(0)]),
                                                  emb.weight.requires_grad))
    emb.__class__ = VocabParallelEmbedding
    emb.tp_mesh, emb.output_layout = tp_mesh, output_layout


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    seq = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "norm": SequenceParallel() if sequence_parallel else None,
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    root_plan = {k: v for k, v in root_plan.items() if v is not None and getattr(model, k, None) is not None}
    parallelize_module(model, tp_mesh, root_plan)
    if model.tok_embeddings is not None:
        vocab_parallel(model.tok_embeddings, tp_mesh, seq)
        model.tok_embeddings.register_forward_hook(_wait_embedding_output)
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        ff = block.feed_forward
        if hasattr(ff, "w1"):  # dense SwiGLU; MoE layers get their own plan in expert.py
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq),
                "feed_forward.w3": ColwiseParallel(),
            })
        else:  # MoE: replicated over tp, see parallel/expert.py
            from ndtrain.parallel.expert import moe_tensor_parallel

            moe_tensor_parallel(ff, tp_mesh, seq)
        parallelize_module(block, tp_mesh, plan)
