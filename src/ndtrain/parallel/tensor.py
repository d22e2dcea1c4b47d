"""Tensor parallel (Megatron column/row split) with optional sequence parallel, via DTensor.

Attention: q/k/v column-parallel (heads, and therefore kv-heads, split across tp), o row-parallel.
MLP: w1/w3 column-parallel, w2 row-parallel. Embedding is row-parallel over the vocabulary; the
head is column-parallel and its logits stay vocab-sharded for `loss_parallel`, so the full
[tokens, vocab] logits never exist on one rank.

With sequence parallel the residual stream and norms are sharded along the sequence between the
TP regions, turning each all-reduce into a reduce-scatter + all-gather pair of the same volume
but 1/tp of the activation memory.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    seq = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "norm": SequenceParallel() if sequence_parallel else None,
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    }
    root_plan = {k: v for k, v in root_plan.items() if v is not None and getattr(model, k, None) is not None}
    parallelize_module(model, tp_mesh, root_plan)
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
