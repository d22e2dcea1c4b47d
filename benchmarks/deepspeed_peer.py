"""DeepSpeed ZeRO-1/3 on the floor's model: the peer a user could pick instead of ndtrain.

Run under torchrun with DS_ACCELERATOR=cpu (DeepSpeed then uses Gloo). Same model, tokens,
AdamW (torch's foreach implementation, handed to DeepSpeed) and clipping as fsdp_floor.py.
Prints one JSON line like the floor.
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, torch.distributed as dist, torch.nn.functional as F
import deepspeed
from floor_model import LM, args, peak_rss_mb

a = args({"stage": 1})
stage = int(a.stage)
deepspeed.init_distributed(dist_backend="gloo")
world = dist.get_world_size()
torch.manual_seed(0)
model = LM(a)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
config = {"train_micro_batch_size_per_gpu": a.mb, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
if a.bf16:
    config["bf16"] = {"enabled": True}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
gen = torch.Generator().manual_seed(1 + dist.get_rank())
times, cpu, first = [], [], None
for step in range(a.steps):
    t0, c0 = time.perf_counter(), time.process_time()
    data = torch.randint(0, a.vocab, (a.mb, a.seq + 1), generator=gen)
    logits = engine(data[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    first = first or time.time()
if dist.get_rank() == 0:
    med = statistics.median(times[a.warmup:])
    print(json.dumps({"impl": f"deepspeed-zero{stage}", "world": world, "step_s": med,
                      "tokens_per_s": a.mb * a.seq * world / med, "first_step_at": first, "step_cpu_s": statistics.median(cpu[a.warmup:]), "peak_rss_mb": peak_rss_mb()}))
# DeepSpeed 0.19.8 on CPU sometimes aborts in its teardown ("terminate called without an active
# exception") after the work is done: leave without it once every rank has finished.
sys.stdout.flush()
dist.barrier()
os._exit(0)
