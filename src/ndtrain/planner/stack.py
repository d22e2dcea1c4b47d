"""The software stack a layout runs on, as far as cost goes, and the bytes of each precision.
(The layout itself, its syntax and its rules are ndtrain.layout's.)

A stack is a set of facts about a code base, never fitted: which kernels it has (flash attention,
fused elementwise kernels) and which communication it overlaps with computation. Each flag says
where it comes from; docs/planner.md ("Stacks") lists them side by side. How *well* an overlap
hides its traffic is a constant with a range (planner/constants.py), the same for every stack that
has the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = {"bf16": 2, "fp8": 2, "fp32": 4}  # bytes per activation / parameter copy
# Activation checkpointing policies the planner models (every_n is the runtime's, not searched).
PLANNED_AC = ("none", "selective", "full")


@dataclass(frozen=True)
class Stack:
    """What the training software does, as far as cost goes."""

    name: str
    flash_attention: bool  # no s x s scores stored; causal kernels skip the masked half
    dropout: bool  # 1-byte masks after attention and MLP (GPT-era models)
    dp_overlap: bool  # gradient reduction overlaps the backward pass
    grad_reduce_bytes: int  # bytes per gradient element on the wire
    # what `ac = selective` recomputes: "scores" (Korthikanti et al.: the attention scores only),
    # "act" (also the MLP activation function), "elementwise" (ndtrain's policy,
    # parallel/activation.py: every matmul and attention output kept, every other forward op
    # recomputed: norms, RoPE, the activation function, residuals, casts), "ops" (torchtitan's
    # op-level policy: keeps the layer input, the attention output and every other matmul output,
    # and recomputes the rest, half of the forward matmuls included)
    selective: str
    # parameter all-gathers (ZeRO-1/2 once per step, ZeRO-3 per layer) prefetched behind compute
    param_overlap: bool = True
    # TP all-gather / reduce-scatter split into chunks and overlapped with the GEMMs that consume
    # or produce them (Megatron-Core's tp_comm_overlap through Transformer Engine's userbuffers,
    # PyTorch's async TP)
    tp_overlap: bool = False
    pp_overlap: bool = True  # steady-state pipeline sends/receives run while the next chunk computes
    cp_overlap: bool = True  # each ring hop of K/V travels while the previous block's attention runs
    # expert all-to-all hidden behind another micro-batch's compute: DualPipe's paired F and B
    ep_overlap: bool = False
    fused_elementwise: bool = False  # fused norm/activation/RoPE/cast kernels (else eager ops)
    fp8_experts: bool = False  # routed and shared expert GEMMs in fp8 too (DeepSeek-V3's recipe)
    # fp8 Linears keep their inputs for the backward as fp8 (1 byte): Transformer Engine saves the
    # casted input, DeepSeek-V3 caches fp8 activations; torchao's Float8Linear (ndtrain) keeps
    # the bf16 input and casts again in the backward
    fp8_saves_fp8: bool = False
    # rank placement: False = ndtrain's and Megatron's mesh [pp, dp, cp, tp] (pipeline stages
    # farthest apart); True = Llama 3's [dp, pp, cp, tp] (section 3.3.2: "[TP, CP, PP, DP]",
    # innermost first), which keeps a pipeline inside a pod and puts data parallelism across pods
    pp_inside_dp: bool = False
    # each token's expert all-to-all reaches at most this many nodes (DeepSeek-V3's node-limited
    # routing: IB carries one copy per node, NVLink fans it out); 0 = no limit
    ep_node_limit: int = 0
    # FSDP2's per-parameter sharding (torch.distributed.fsdp.fully_shard): every all-gather is
    # copied out of its flat buffer into the parameters (foreach_all_gather_copy_out) and every
    # reduce-scatter's input is copied in, cast to the reduce dtype (foreach_reduce's _chunk_cat),
    # HBM traffic on the compute stream. Flat-buffer implementations (FSDP1, DeepSpeed, Megatron's
    # distributed optimizer) gather into and reduce from the parameters' own storage.
    fsdp_copies: bool = False
    # bytes per element of a gradient held whole across micro-batches (a pipeline reduces once
    # per step, ZeRO-1 on the last micro-batch): FSDP2 accumulates it unsharded in its reduce
    # dtype (fp32 in ndtrain: the dry run's first pipeline stage holds it so), 2 where the stack
    # accumulates in the parameters' bf16
    whole_grad_bytes: int = 2
    # where the fp32 master weights live under mixed precision: FSDP's (torch fully_shard's
    # MixedPrecisionPolicy) keeps each parameter's fp32 shard as the parameter, reduces into an
    # fp32 gradient of it and casts to bf16 only into the gathered copy the forward and backward
    # use (4 + 4 + 8 bytes a parameter, the copy a communication buffer); False: a bf16 model
    # with the fp32 master inside the optimizer (Megatron's distributed optimizer, DeepSpeed:
    # 2 + 2 + 12). The same 16 bytes either way, filed differently.
    master_in_params: bool = False
    # ZeRO-3 leaves the root group (embedding, final norm, head) gathered from its forward to the
    # step's last backward (ndtrain: parallel/data_parallel.apply_fsdp, fully_shard(model,
    # reshard_after_forward=False)); False: it reshards like a block
    root_kept_gathered: bool = False
    # the loss kernel over the vocabulary (planner/layer.py LOSS_BYTES, planner/memory.py):
    # "eager" PyTorch cross-entropy (fp32 upcast, log-softmax, dense NLL gradient), "fused"
    # (a vocab-parallel fused kernel in fp32: Megatron-Core, TE, fused stacks), "flash"
    # (flash-attn's bf16 cross-entropy kernel: keeps only the bf16 logits; LLM Foundry's default)
    loss: str = "eager"
    # which flash kernels: "" the GPU generation's own (cuDNN / FlashAttention-3 on Hopper:
    # `attn_eff`), "fa2" FlashAttention-2-class kernels written for Ampere (FA2, Triton's, PyTorch
    # SDPA's flash backend), which reach far less of Hopper's peak (`attn_eff_fa2`)
    attention_kernel: str = ""
    source: str = ""


STACKS = {
    # ndtrain as it is (src/ndtrain/parallel): SDPA flash kernels, no dropout; FSDP2 prefetches
    # parameter gathers and reduces gradients in fp32 behind the backward (DDP buckets likewise);
    # TP through DTensor with no async TP; the ring attention starts each K/V hop before the block
    # it feeds; torch.distributed.pipelining sends asynchronously; DualPipeV's paired F and B run
    # in turn (torch's default OVERLAP_F_B), so expert all-to-alls are exposed; eager elementwise
    # ops unless [parallel] compile = true.
    "ndtrain": Stack("ndtrain", flash_attention=True, dropout=False, dp_overlap=True, grad_reduce_bytes=4,
                     selective="elementwise", fsdp_copies=True, attention_kernel="fa2", whole_grad_bytes=4,
                     master_in_params=True, root_kept_gathered=True, source="src/ndtrain/parallel"),
    # Megatron-LM as of Narayanan et al. 2021: unfused softmax over s x s with dropout, fp16
    # gradients all-reduced after the backward (the local DDP of that release), blocking p2p.
    "megatron-2021": Stack("megatron-2021", flash_attention=False, dropout=True, dp_overlap=False,
                           grad_reduce_bytes=2, selective="scores", param_overlap=False, pp_overlap=False,
                           cp_overlap=False, source="Narayanan et al. 2021, sections 4.1-4.2"),
    # Megatron-Core / NeMo 2024 performance recipes: TE fused kernels and flash (cuDNN) attention,
    # tp_comm_overlap, distributed optimizer with overlap_grad_reduce / overlap_param_gather,
    # overlap_p2p_comm for interleaved pipelines, CP ring with overlapped p2p; bf16 gradient
    # reduction (grad_reduce_in_fp32 off).
    "megatron-core-2024": Stack("megatron-core-2024", flash_attention=True, dropout=False, dp_overlap=True,
                                grad_reduce_bytes=2, selective="scores", tp_overlap=True, fused_elementwise=True, loss="fused",
                                fp8_saves_fp8=True, source="Megatron-Core / NeMo performance recipes (NeMo 24.07, Megatron-Bridge 25.11)"),
    # torchtitan (Liang et al. 2024): FSDP2 with prefetch and fp32 reduction, SDPA flash kernels,
    # torch.distributed.pipelining; async TP and torch.compile are options (compile = fused
    # elementwise through the layout's `compile` knob; async TP is not assumed).
    "torchtitan-2024": Stack("torchtitan-2024", flash_attention=True, dropout=False, dp_overlap=True,
                             grad_reduce_bytes=4, selective="ops", fsdp_copies=True, attention_kernel="fa2",
                             master_in_params=True, source="Liang et al. 2024; torchtitan docs"),
    # Meta's Llama 3 stack as the paper describes it (Dubey et al. 2024, section 3.3.2): FSDP-style
    # sharding of optimizer states and gradients with parameters kept after the forward, gradient
    # reduction overlapped, all-gather based context parallelism (K/V gathered before attention,
    # not a ring), fused kernels, the [TP, CP, PP, DP] rank order. TP overlap is not described, so
    # not assumed; nor is the recompute policy: the 8K layout fits 80 GB only if at least the
    # MLP activation is recomputed, so selective recompute ("act") is assumed.
    "llama3-2024": Stack("llama3-2024", flash_attention=True, dropout=False, dp_overlap=True, grad_reduce_bytes=4,
                         selective="act", cp_overlap=False, fused_elementwise=True, pp_inside_dp=True, loss="fused",
                         source="Dubey et al. 2024, section 3.3"),
    # DeepSeek-V3's HAI-LLM (DeepSeek-AI 2024, section 3.2-3.3): DualPipe overlaps the expert
    # all-to-all and pipeline traffic with another micro-batch's compute; routing limited to 4
    # nodes per token; fine-grained fp8 GEMMs including the experts; ZeRO-1 overlapped.
    "deepseek-2024": Stack("deepseek-2024", flash_attention=True, dropout=False, dp_overlap=True, grad_reduce_bytes=4,
                           selective="act", ep_overlap=True, fused_elementwise=True, fp8_experts=True, loss="fused",
                           fp8_saves_fp8=True, ep_node_limit=4, source="DeepSeek-AI 2024 (DeepSeek-V3 technical report), 3.2-3.3"),
    # MosaicML's LLM Foundry on Composer (the MPT benchmarks): FSDP1 FULL_SHARD over flat
    # parameters (limit_all_gathers, backward prefetch), flash/Triton attention, no dropout, eager
    # elementwise ops (low-precision LayerNorm, no compile), fp32 gradient reduction under the
    # DEFAULT mixed-precision mode, full activation checkpointing where the table says "True";
    # fp8 through Transformer Engine's Linear, which saves its fp8 inputs; the loss is flash-attn's
    # bf16 cross-entropy kernel (loss_fn: fused_crossentropy, the default) (mosaicml/llm-foundry
    # scripts/train/benchmarking/README.md and scripts/train/yamls/pretrain/mpt-*.yaml).
    "llm-foundry-2023": Stack("llm-foundry-2023", flash_attention=True, dropout=False, dp_overlap=True,
                              grad_reduce_bytes=4, selective="scores", fp8_saves_fp8=True, loss="flash",
                              attention_kernel="fa2",
                              source="mosaicml/llm-foundry benchmarking README and MPT yamls"),
}


def stack_names() -> list[str]:
    return list(STACKS)
