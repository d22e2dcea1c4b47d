"""The floor: a plain-PyTorch FSDP2 Llama training loop, no ndtrain import.

Same shape, data distribution and optimizer as the ndtrain run it is compared with. Run under
torchrun (or plain python for world 1); prints one JSON line with the median step time.
"""
import argparse, json, os, statistics, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
for k, v in dict(dim=256, layers=6, heads=16, ffn=768, vocab=2048, seq=256, mb=4, steps=25, warmup=5).items():
    p.add_argument(f"--{k}", type=int, default=v)
a = p.parse_args()

class Norm(nn.Module):
    def __init__(s, d): super().__init__(); s.w = nn.Parameter(torch.ones(d))
    def forward(s, x): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * s.w

def rope(x, theta=5e5):
    b, t, h, d = x.shape
    f = torch.outer(torch.arange(t, dtype=torch.float32), 1.0 / theta ** (torch.arange(0, d, 2) / d))
    c, s, x1, x2 = f.cos()[None, :, None], f.sin()[None, :, None], x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

class Block(nn.Module):
    def __init__(s, d, h, f):
        super().__init__(); s.h = h
        s.n1, s.n2, s.qkv, s.o = Norm(d), Norm(d), nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        s.w1, s.w3, s.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
    def forward(s, x):
        b, t, d = x.shape
        q, k, v = s.qkv(s.n1(x)).view(b, t, 3, s.h, d // s.h).unbind(2)
        y = F.scaled_dot_product_attention(rope(q).transpose(1, 2), rope(k).transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + s.o(y.transpose(1, 2).reshape(b, t, d))
        h = s.n2(x)
        return x + s.w2(F.silu(s.w1(h)) * s.w3(h))

class LM(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb, s.norm, s.out = nn.Embedding(a.vocab, a.dim), Norm(a.dim), nn.Linear(a.dim, a.vocab, bias=False)
        s.blocks = nn.ModuleList(Block(a.dim, a.heads, a.ffn) for _ in range(a.layers))
    def forward(s, x):
        x = s.emb(x)
        for blk in s.blocks: x = blk(x)
        return s.out(s.norm(x))

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = LM()
if world > 1:
    for blk in model.blocks: fully_shard(blk)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
gen = torch.Generator().manual_seed(1 + (dist.get_rank() if world > 1 else 0))
times = []
for step in range(a.steps):
    t0 = time.perf_counter()
    data = torch.randint(0, a.vocab, (a.mb, a.seq + 1), generator=gen)
    loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
if world == 1 or dist.get_rank() == 0:
    med = statistics.median(times[a.warmup:])
    print(json.dumps({"impl": "floor", "world": world, "step_s": med, "tokens_per_s": a.mb * a.seq * world / med}))
if world > 1:
    dist.destroy_process_group()
