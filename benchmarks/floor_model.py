"""The peers' model, in plain PyTorch (no ndtrain import): a Llama with fused qkv, RoPE, SwiGLU.

Shared by the plain FSDP2 floor (fsdp_floor.py) and the DeepSpeed peer (deepspeed_peer.py), so
every peer trains the same module on the same random tokens.
"""
import torch
import torch.nn.functional as F
from torch import nn

SHAPE = dict(dim=256, layers=6, heads=16, ffn=768, vocab=2048, seq=256, mb=4, steps=25, warmup=5)


class Norm(nn.Module):
    def __init__(s, d): super().__init__(); s.w = nn.Parameter(torch.ones(d))
    def forward(s, x): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * s.w


def rope(x, theta=5e5):
    b, t, h, d = x.shape
    f = torch.outer(torch.arange(t, dtype=torch.float32), 1.0 / theta ** (torch.arange(0, d, 2) / d))
    c, s, x1, x2 = f.cos()[None, :, None], f.sin()[None, :, None], x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).type_as(x)


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
    def __init__(s, a):
        super().__init__()
        s.emb, s.norm, s.out = nn.Embedding(a.vocab, a.dim), Norm(a.dim), nn.Linear(a.dim, a.vocab, bias=False)
        s.blocks = nn.ModuleList(Block(a.dim, a.heads, a.ffn) for _ in range(a.layers))

    def forward(s, x):
        x = s.emb(x)
        for blk in s.blocks: x = blk(x)
        return s.out(s.norm(x))


def args(extra=None):
    import argparse
    p = argparse.ArgumentParser()
    for k, v in SHAPE.items():
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--bf16", action="store_true")
    for k, v in (extra or {}).items():
        p.add_argument(f"--{k}", default=v)
    return p.parse_args()


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
