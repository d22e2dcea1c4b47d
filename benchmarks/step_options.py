"""What per-step options are worth on this CPU, for the peers' model, in one process (no
communication, no optimizer): the compute a data-parallel rank cannot avoid.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_options.py [--passes 7] [--precision fp32]

Forward + backward of one micro-batch (4 x 256 tokens, the peers' shape: common.PEER_MODEL),
CPU seconds, one thread, interleaved passes (every variant once per pass), median over passes:

  eager        ndtrain's model as it trains (separate wq/wk/wv and w1/w3 projections)
  fused        the same weights as one qkv and one gate/up matrix, each split after its matmul
               (what fused projections would do; built here on the same modules, weights copied)
  compiled     ndtrain's model with every block torch.compile'd (as [parallel] compile = true);
               its compile time (the first step, with a fresh inductor cache unless
               --warm-cache) is reported on its own
  floor-model  the plain-PyTorch floor's module (floor_model.py, fused qkv)

It also prints the tokens per CPU-second that the eager model alone reaches: the ceiling of any
data-parallel layout of it on one thread per rank, which bounds what a layout can gain on a peer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--warm-cache" not in sys.argv:  # a cold compile, as a fresh machine (or a changed model) pays it
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ndtrain-inductor-")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from common import PEER_MODEL  # noqa: E402


def fuse(model: nn.Module) -> nn.Module:
    """Give every attention one qkv matmul and every feed-forward one gate/up matmul, with the
    model's own weights (concatenated), by swapping their forward methods."""
    from ndtrain.model.llama import apply_rope, rope_cos_sin

    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        att.wqkv = nn.Parameter(torch.cat([att.wq.weight, att.wk.weight, att.wv.weight]).detach().clone())
        ffn.w13 = nn.Parameter(torch.cat([ffn.w1.weight, ffn.w3.weight]).detach().clone())
        sizes = (att.wq.out_features, att.wk.out_features, att.wv.out_features)

        def att_forward(x, positions, doc_ids=None, att=att, sizes=sizes):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, -1, att.head_dim) for t in F.linear(x, att.wqkv).split(sizes, dim=-1))
            cos, sin = rope_cos_sin(positions, att.head_dim, att.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = att.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return att.wo(out.transpose(1, 2).reshape(b, s, -1))

        def ffn_forward(x, ffn=ffn):
            gate, up = F.linear(x, ffn.w13).chunk(2, dim=-1)
            return ffn.w2(F.silu(gate) * up)

        att.forward, ffn.forward = att_forward, ffn_forward
        for lin in (att.wq, att.wk, att.wv, ffn.w1, ffn.w3):
            lin.weight.requires_grad_(False)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="micro-batches per variant per pass")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variant (its compile takes ~15-60 s)")
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (default: a fresh one)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from types import SimpleNamespace

    import floor_model
    from ndtrain.model.config import ModelConfig
    from ndtrain.model.llama import build_model

    cfg = ModelConfig(**PEER_MODEL)
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    base = build_model(cfg, "cpu")

    def copy_of_base():
        m = build_model(cfg, "cpu")
        m.load_state_dict(base.state_dict())
        return m

    shape = SimpleNamespace(vocab=cfg.vocab_size, dim=cfg.dim, layers=cfg.n_layers, heads=cfg.n_heads, ffn=cfg.ffn_dim)
    variants = {"eager": base, "fused": fuse(copy_of_base()), "floor-model": floor_model.LM(shape)}
    if not a.no_compile:
        compiled = copy_of_base()
        for block in compiled.layers.values():
            block.compile()
        variants["compiled"] = compiled
    tokens = torch.randint(0, cfg.vocab_size, (a.mb, a.seq + 1))

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    first = {}
    for name, model in variants.items():
        wall, cpu = time.perf_counter(), time.process_time()
        loss = step(model)
        first[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        print(f"{name:12s} first step {first[name][0]:6.2f} s wall, {first[name][1]:6.2f} s CPU of this process; "
              f"loss {loss.item():.6f}", flush=True)
    results: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for i in range(a.passes):
        for name in names[i % len(names):] + names[:i % len(names)]:
            c0 = time.process_time()
            for _ in range(a.steps):
                step(variants[name])
            results[name].append((time.process_time() - c0) / a.steps)
    tokens_per_mb = a.mb * a.seq
    eager = statistics.median(results["eager"])
    print(f"\n{a.precision}, micro-batch {a.mb} x {a.seq}, 1 thread, {a.passes} interleaved passes, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| variant | CPU s per micro-batch (median) | per pass | / eager | tokens per CPU-second |\n|---|---|---|---|---|")
    for name, xs in results.items():
        med = statistics.median(xs)
        print(f"| {name} | {med * 1e3:.1f} ms | {' / '.join(f'{x * 1e3:.0f}' for x in xs)} | {med / eager:.3f} | "
              f"{tokens_per_mb / med:,.0f} |")
    if "compiled" in results:
        saved = eager - statistics.median(results["compiled"])
        print(f"\ncompile: {first['compiled'][0]:.1f} s wall for the first step; it saves {saved * 1e3:.1f} ms per "
              f"micro-batch, so it repays itself after ~{first['compiled'][0] / saved:,.0f} micro-batches"
              if saved > 0 else "\ncompile: no saving per micro-batch here")


if __name__ == "__main__":
    main()
