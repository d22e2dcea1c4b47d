"""The floor: a plain-PyTorch FSDP2 Llama training loop, no ndtrain import.

Same shape, data distribution and optimizer as the ndtrain run it is compared with. Run under
torchrun (or plain python for world 1); prints one JSON line with the median step time, this
rank-0 process's peak RSS and the wall-clock time its first step ended (time to first step).
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from floor_model import LM, args, peak_rss_mb

a = args()
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = LM(a)
if world > 1:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16 else MixedPrecisionPolicy()
    for blk in model.blocks: fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
gen = torch.Generator().manual_seed(1 + (dist.get_rank() if world > 1 else 0))
autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16 and world == 1)
times, cpu, first = [], [], None
for step in range(a.steps):
    t0, c0 = time.perf_counter(), time.process_time()
    data = torch.randint(0, a.vocab, (a.mb, a.seq + 1), generator=gen)
    with autocast:
        logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    first = first or time.time()
if world == 1 or dist.get_rank() == 0:
    med = statistics.median(times[a.warmup:])
    print(json.dumps({"impl": "floor", "world": world, "step_s": med, "tokens_per_s": a.mb * a.seq * world / med,
                      "first_step_at": first, "step_cpu_s": statistics.median(cpu[a.warmup:]), "peak_rss_mb": peak_rss_mb()}))
if world > 1:
    dist.destroy_process_group()
