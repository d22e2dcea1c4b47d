"""Published training runs: every figure with its source, and whether it was used to fit a
constant ("fit") or only to check the model ("validation"). planner/published.py predicts them.

Each row is the published layout (the degrees the source states, pinned; what it does not state,
such as the micro-batch or recompute policy when absent, is completed by the planner's search),
the stack the run used (planner/stack.py: facts, not fits) and the published figure in its own
metric:
  tflops_megatron  Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) per step,
                   counting the recomputed forward
  tflops_causal    6N + the causal half of attention per token (what Llama 3's figures match)
  tokens_per_gpu   tokens per second per GPU
  step_s           seconds per optimizer step
Nothing here is a fitted value; the constants live in planner/constants.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ndtrain.layout.schedules import DEFAULT, DEFAULT_INTERLEAVED, DUALPIPEV

SOURCES = {
    "narayanan2021": "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
                     "Megatron-LM' (SC21), Table 1",
    "llama3": "Dubey et al. 2024, 'The Llama 3 Herd of Models', Table 4 (BF16 TFLOPs/GPU); cluster: section 3.3.1",
    "nemo2407": "NVIDIA NeMo 24.07 performance summary, DGX-H100, FP8 (NVIDIA/NeMo "
                "docs/source/performance/performance_summary.md, commit 8e3d65dc '24.07 perf numbers')",
    "bridge": "NVIDIA Megatron-Bridge performance summary archive, DGX-H100, FP8-CS, containers 25.11 and 26.02 "
              "(NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md)",
    "deepseekv3": "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report', Table 1 (2.664M H800 GPU hours for 14.8T "
                  "pre-training tokens) and section 3.2 (2,048 H800, PP16, EP64, ZeRO-1)",
    "torchtitan": "torchtitan docs/performance.md (pytorch/torchtitan at commit 04133643), 64 A100 80GB, FSDP2: "
                  "Llama 3 and Llama 2 tables (WPS per GPU)",
    "mtnlg": "Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', section 2.4: "
             "batch 1920 on 280/350/420 DGX A100, 60.1/50.2/44.4 s per iteration",
    "bloom": "BigScience 2022, 'BigScience 176B Model' training page and BLOOM paper (Le Scao et al. 2022, "
             "section 3.4): 384 A100 80GB, one replica on 48 GPUs (TP4 x PP12), 'training throughput: about 150 "
             "TFLOPs'; 4 x 100 Gb/s Omni-Path per node",
    "llmfoundry": "MosaicML LLM Foundry, scripts/train/benchmarking/README.md (mosaicml/llm-foundry at commit "
                  "061f2c7c): MPT on 'H100 80GB BF16', 'H100 80GB FP8' and 'A100 80GB with 1600 Gbps node-node "
                  "interconnect (RoCE)', FSDP FULL_SHARD, Throughput (T/s/GPU); shapes from "
                  "scripts/train/yamls/pretrain/mpt-{3b,7b,13b,30b}.yaml",
}

# Models named by their published shape (`--model-shape` syntax); presets are named as such.
GPT = "layers={l},hidden={h},heads={a},mlp=gelu,vocab={v},tie=1"
LLAMA2 = {
    "llama2-7b": "layers=32,hidden=4096,heads=32,kv_heads=32,ffn=11008,vocab=32000",
    "llama2-13b": "layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000",
    "llama2-70b": "layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000",
}
# Meta's Llama 3 cluster (section 3.3.1): 400 Gb/s RoCE per GPU; pods of 3,072 GPUs with full
# bisection; 1:7 oversubscription between pods.
META_NETWORK = {"pod_gpus": 3072, "oversubscription": 7.0}
# Jean Zay (BLOOM): 4 x 100 Gb/s Omni-Path per 8-GPU node = 6.25 GB/s per GPU and direction.
JEAN_ZAY = {"nic_bw": 6.25e9}


@dataclass(frozen=True)
class Row:
    source: str
    name: str
    model: str  # a preset name or a --model-shape string
    gpu: str
    gpus: int
    seq: int
    batch: int  # sequences per step
    fixed: dict
    stack: str
    precision: str
    metric: str
    published: float
    role: str  # "fit" | "validation"
    network: dict = field(default_factory=dict)
    mb: tuple = ()  # micro-batch sizes to search ((): the planner's default)
    note: str = ""


def _t1(params, a, h, l, tp, pp, gpus, batch, tflops) -> Row:
    fixed = dict(tp=tp, pp=pp, cp=1, ep=1, dp_shard=1, dp_replicate=gpus // (tp * pp), activation_checkpoint="full",
                 sequence_parallel=False)
    if pp > 1:
        fixed["pp_schedule"] = DEFAULT_INTERLEAVED  # Megatron's interleaved 1F1B
    return Row("narayanan2021", f"GPT {params}B, {gpus} A100", GPT.format(l=l, h=h, a=a, v=51200), "a100-80", gpus,
               2048, batch, fixed, "megatron-2021", "bf16", "tflops_megatron", tflops, "fit",
               note="micro-batch and v not published: the planner picks them")


def _mcore(source, name, model, gpus, batch, mb, seq, tp, pp, cp, vp, value, zero=1, **kw) -> Row:
    dp = gpus // (tp * pp * cp)
    fixed = dict(tp=tp, pp=pp, cp=cp, ep=1, dp_shard=dp, dp_replicate=1, zero=zero, micro_batch=mb,
                 pp_virtual_stages=max(1, vp), sequence_parallel=tp > 1)
    if pp > 1:
        fixed["pp_schedule"] = DEFAULT_INTERLEAVED if vp > 1 else DEFAULT
    return Row(source, name, model, "h100", gpus, seq, batch, fixed, "megatron-core-2024", "fp8", "tokens_per_gpu",
               value, kw.pop("role", "validation"), mb=(mb,), **kw)


# MPT shapes (GeLU MLP of 4h, tied embeddings, vocab 50368; learned positions are left out: under
# 0.3% of the parameters at 2K); the benchmark table's parameter counts match them.
MPT = {size: GPT.format(l=l, h=h, a=a, v=50368) for size, (l, h, a) in
       {"3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56)}.items()}


def _mpt(size, gpu, gpus, seq, mb, batch, ac, value, precision="bf16") -> Row:
    fixed = dict(tp=1, pp=1, cp=1, ep=1, dp_shard=gpus, dp_replicate=1, zero=3, micro_batch=mb,
                 activation_checkpoint="full" if ac else "none")
    return Row("llmfoundry", f"MPT-{size} {seq // 1024}K, {gpus} {gpu.split('-')[0].upper()}"
               + (" fp8" if precision == "fp8" else "") + (", AC" if ac else ""), MPT[size], gpu, gpus, seq, batch,
               fixed, "llm-foundry-2023", precision, "tokens_per_gpu", value, "validation", mb=(mb,),
               note="Composer's FSDP1 FULL_SHARD; the H100 network is not stated (NDR assumed)")


def _titan(name, model, seq, local, ac, value) -> Row:
    fixed = dict(tp=1, pp=1, cp=1, ep=1, dp_shard=64, dp_replicate=1, zero=3, micro_batch=local,
                 activation_checkpoint=ac)
    return Row("torchtitan", name, model, "a100-80", 64, seq, 64 * local, fixed, "torchtitan-2024", "bf16",
               "tokens_per_gpu", value, "validation", mb=(local,),
               note="the A100 cluster's network is not stated: HDR InfiniBand assumed")


ROWS: tuple[Row, ...] = (
    # --- Megatron-LM 2021, Table 1: fits the Ampere GEMM ceiling and the eager elementwise traffic
    _t1(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), _t1(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    _t1(7.5, 32, 4096, 36, 4, 1, 128, 512, 142), _t1(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    _t1(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), _t1(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _t1(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), _t1(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _t1(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), _t1(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    # --- Llama 3 405B, Table 4: the 8K rows fit the Hopper GEMM ceiling; 131K checks
    Row("llama3", "Llama 3 405B, 8,192 H100, 8K", "llama3-405b", "h100", 8192, 8192, 2048,
        dict(tp=8, cp=1, pp=16, dp_shard=64, dp_replicate=1, pp_schedule=DEFAULT_INTERLEAVED), "llama3-2024", "bf16",
        "tflops_causal", 430, "fit", META_NETWORK),
    Row("llama3", "Llama 3 405B, 16,384 H100, 8K", "llama3-405b", "h100", 16384, 8192, 2048,
        dict(tp=8, cp=1, pp=16, dp_shard=128, dp_replicate=1, pp_schedule=DEFAULT_INTERLEAVED), "llama3-2024", "bf16",
        "tflops_causal", 400, "fit", META_NETWORK),
    Row("llama3", "Llama 3 405B, 16,384 H100, 131K", "llama3-405b", "h100", 16384, 131072, 128,
        dict(tp=8, cp=16, pp=16, dp_shard=8, dp_replicate=1, pp_schedule=DEFAULT_INTERLEAVED), "llama3-2024", "bf16",
        "tflops_causal", 380, "validation", META_NETWORK),
    # --- NeMo 24.07, FP8 on DGX-H100 (tokens/s/GPU); LLAMA2-7B fits the fp8 GEMM ceiling
    _mcore("nemo2407", "NeMo LLAMA2-7B, 8 H100", LLAMA2["llama2-7b"], 8, 128, 1, 4096, 1, 1, 1, 1, 16847, role="fit"),
    _mcore("nemo2407", "NeMo GPT3-5B, 64 H100", GPT.format(l=24, h=4096, a=32, v=51200), 64, 2048, 4, 2048, 1, 1, 1, 1,
           22521, note="GPT3 recipes keep dropout 0.1, which the stack does not price"),
    _mcore("nemo2407", "NeMo GPT3-20B, 64 H100", GPT.format(l=44, h=6144, a=48, v=51200), 64, 256, 2, 2048, 2, 1, 1, 1,
           5851, note="dropout 0.1 not priced"),
    _mcore("nemo2407", "NeMo GPT3-175B, 128 H100", GPT.format(l=96, h=12288, a=96, v=51200), 128, 256, 1, 2048, 4, 8, 1,
           6, 726, note="dropout 0.1 not priced"),
    _mcore("nemo2407", "NeMo GPT3-175B, 512 H100", GPT.format(l=96, h=12288, a=96, v=51200), 512, 2048, 2, 2048, 4, 8, 1,
           6, 782, note="dropout 0.1 not priced"),
    _mcore("nemo2407", "NeMo LLAMA2-13B, 16 H100", LLAMA2["llama2-13b"], 16, 128, 1, 4096, 1, 4, 1, 10, 8646),
    _mcore("nemo2407", "NeMo LLAMA2-70B, 64 H100", LLAMA2["llama2-70b"], 64, 128, 1, 4096, 4, 4, 1, 20, 1707),
    _mcore("nemo2407", "NeMo LLAMA3-8B, 8 H100", "llama3-8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12036),
    _mcore("nemo2407", "NeMo LLAMA3-70B, 64 H100", "llama3-70b", 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
    # --- Megatron-Bridge (Megatron-Core), FP8-CS on DGX-H100
    _mcore("bridge", "Bridge 25.11 LLAMA3-8B, 8 H100 (FSDP)", "llama3-8b", 8, 128, 1, 8192, 1, 1, 1, 1, 14451, zero=3),
    _mcore("bridge", "Bridge 25.11 LLAMA3-70B, 64 H100", "llama3-70b", 64, 128, 1, 8192, 4, 8, 1, 5, 1602),
    _mcore("bridge", "Bridge 25.11 LLAMA3.1-405B, 1,024 H100", "llama3-405b", 1024, 512, 1, 8192, 8, 8, 2, 8, 292),
    _mcore("bridge", "Bridge 26.02 LLAMA3-70B, 64 H100", "llama3-70b", 64, 256, 1, 8192, 4, 8, 1, 5, 1621),
    _mcore("bridge", "Bridge 26.02 LLAMA3.1-405B, 1,024 H100", "llama3-405b", 1024, 1536, 1, 8192, 8, 8, 2, 8, 311),
    # --- DeepSeek-V3 on 2,048 H800: fp8, DualPipe, EP64 (whole-run GPU hours, so failures included)
    Row("deepseekv3", "DeepSeek-V3, 2,048 H800", "deepseek-v3", "h800", 2048, 4096, 15360,
        dict(tp=1, cp=1, pp=16, ep=64, dp_shard=128, dp_replicate=1, zero=1, pp_schedule=DUALPIPEV), "deepseek-2024",
        "fp8", "tokens_per_gpu", 14.8e12 / 2.664e6 / 3600, "validation",
        note="GPU hours of the whole run (restarts included); MLA modelled as multi-head attention"),
    # --- torchtitan on 64 A100 (FSDP2, eager)
    _titan("torchtitan Llama 3 8B, selective", "llama3-8b", 8192, 1, "selective", 2973),
    _titan("torchtitan Llama 3 70B, full", "llama3-70b", 8192, 1, "full", 331),
    _titan("torchtitan Llama 2 13B, no AC", LLAMA2["llama2-13b"], 4096, 2, "none", 2162),
    _titan("torchtitan Llama 2 13B, selective", LLAMA2["llama2-13b"], 4096, 2, "selective", 1904),
    _titan("torchtitan Llama 2 70B, selective", LLAMA2["llama2-70b"], 4096, 1, "selective", 355),
    _titan("torchtitan Llama 2 70B, full", LLAMA2["llama2-70b"], 4096, 2, "full", 353),
    # --- MPT on LLM Foundry (FSDP FULL_SHARD on one to eight nodes): sizes 3B-30B, 2K-32K
    # tokens, with and without full recompute, H100 bf16 and fp8, A100; a spread of sizes and
    # sequence lengths from the tables, not chosen by their errors
    _mpt("3b", "h100", 64, 2048, 6, 1152, False, 22525), _mpt("3b", "h100", 8, 8192, 3, 144, False, 16578),
    _mpt("7b", "h100", 8, 2048, 6, 48, False, 10643), _mpt("7b", "h100", 8, 8192, 8, 128, True, 6935),
    _mpt("7b", "h100", 8, 32768, 2, 32, True, 3318), _mpt("13b", "h100", 64, 2048, 2, 128, False, 4800),
    _mpt("13b", "h100", 8, 4096, 10, 240, True, 4717), _mpt("30b", "h100", 32, 2048, 14, 1344, True, 2308),
    _mpt("3b", "h100", 8, 2048, 10, 480, False, 30586, "fp8"), _mpt("3b", "h100", 8, 8192, 3, 144, False, 19146, "fp8"),
    _mpt("3b", "a100-80", 8, 8192, 3, 144, False, 7695), _mpt("7b", "a100-80", 8, 2048, 6, 96, False, 4641),
    _mpt("13b", "a100-80", 8, 4096, 10, 240, True, 2060), _mpt("30b", "a100-80", 8, 2048, 3, 504, True, 916),
    # --- MT-NLG 530B (Megatron TP + DeepSpeed 1F1B pipeline, full recompute): seconds per step
    *(Row("mtnlg", f"MT-NLG 530B, {n} A100", GPT.format(l=105, h=20480, a=128, v=51200), "a100-80", n, 2048, 1920,
          dict(tp=8, pp=35, cp=1, ep=1, dp_shard=1, dp_replicate=n // 280, activation_checkpoint="full",
               sequence_parallel=False, pp_schedule=DEFAULT),
          "megatron-2021", "bf16", "step_s", s, "validation") for n, s in ((2240, 60.1), (2800, 50.2), (3360, 44.4))),
    # --- BLOOM 176B (Megatron-DeepSpeed, ZeRO-1, 1F1B pipeline), Omni-Path network
    Row("bloom", "BLOOM 176B, 384 A100", GPT.format(l=70, h=14336, a=112, v=250880), "a100-80", 384, 2048, 2048,
        dict(tp=4, pp=12, cp=1, ep=1, dp_shard=8, dp_replicate=1, zero=1, activation_checkpoint="full",
             sequence_parallel=False, pp_schedule=DEFAULT),
        "megatron-2021", "bf16", "tflops_megatron", 150, "validation", JEAN_ZAY,
        note="'about 150 TFLOPs'; vocab 250,680 padded to 250,880"),
)
