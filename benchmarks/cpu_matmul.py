"""fp32 linear matmuls on this CPU: torch's BLAS (MKL in the pip wheel) vs oneDNN, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_matmul.py [--passes 7] [--tokens 1024]

The peers' model shapes (common.PEER_MODEL: dim 256, ffn 768, vocab 2048) at `--tokens` rows,
one thread. For each shape, the three matmuls of a Linear: forward (x @ W^T), input gradient
(g @ W) and weight gradient (g^T @ x), each through `torch.mm` (the BLAS) and through
`torch.ops.mkldnn._linear_pointwise` (oneDNN, what model/linear.py calls). Interleaved passes,
the median of each; ratio = BLAS time / oneDNN time (above 1: oneDNN faster). Then one whole
forward + backward of the model with `cpu_matmul` onednn vs blas, CPU time, interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import PEER_MODEL  # noqa: E402


def _dnn(a, w):
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


def timed(fn, reps: int = 5) -> float:
    fn()
    t = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, f, v, n = PEER_MODEL["dim"], PEER_MODEL["ffn_dim"], PEER_MODEL["vocab_size"], a.tokens
    shapes = {"q/k/v/o (256->256)": (d, d), "w1/w3 (256->768)": (d, f), "w2 (768->256)": (f, d),
              "head (256->2048)": (d, v)}
    cases = {}
    for name, (k, m) in shapes.items():
        x, w, g = torch.randn(n, k), torch.randn(m, k), torch.randn(n, m)
        cases[(name, "forward")] = (lambda x=x, w=w: x @ w.t(), lambda x=x, w=w: _dnn(x, w))
        cases[(name, "input grad")] = (lambda g=g, w=w: g @ w, lambda g=g, w=w: _dnn(g, w.t()))
        cases[(name, "weight grad")] = (lambda g=g, x=x: g.t() @ x, lambda g=g, x=x: _dnn(g.t(), x.t()))
    times = {key: ([], []) for key in cases}
    load = [os.getloadavg()[0]]
    for _ in range(a.passes):
        for key, (blas, dnn) in cases.items():
            order = [(0, blas), (1, dnn)] if len(times[key][0]) % 2 == 0 else [(1, dnn), (0, blas)]
            for i, fn in order:
                times[key][i].append(timed(fn))
    load.append(os.getloadavg()[0])
    print(f"one thread, {n} tokens, {a.passes} interleaved passes, CPU time, medians; load {load[0]:.1f}->{load[1]:.1f}\n")
    print("| shape | matmul | BLAS (ms) | oneDNN (ms) | BLAS / oneDNN |")
    print("|---|---|---|---|---|")
    for (name, what), (tb, td) in times.items():
        mb, md = statistics.median(tb), statistics.median(td)
        print(f"| {name} | {what} | {mb * 1e3:.2f} | {md * 1e3:.2f} | {mb / md:.2f} |")
    model_step(a.passes)


def model_step(passes: int) -> None:
    """Forward + backward of the peers' model (4 x 256 tokens) with each kernel, interleaved."""
    from ndtrain.model.config import ModelConfig
    from ndtrain.model.linear import set_cpu_kernel
    from ndtrain.model.llama import build_model

    model = build_model(ModelConfig(**PEER_MODEL), "cpu")
    x = torch.randint(0, PEER_MODEL["vocab_size"], (4, 257))

    def step():
        out = model(x[:, :-1])
        torch.nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten()).backward()

    res = {"blas": [], "onednn": []}
    load0 = os.getloadavg()[0]
    for i in range(passes):
        for kernel in (("blas", "onednn") if i % 2 == 0 else ("onednn", "blas")):
            set_cpu_kernel(model, kernel)
            res[kernel].append(timed(step, reps=3))
    mb, md = statistics.median(res["blas"]), statistics.median(res["onednn"])
    print(f"\nmodel forward + backward (1,024 tokens): blas {mb * 1e3:.0f} ms, onednn {md * 1e3:.0f} ms, "
          f"blas / onednn {mb / md:.3f}; load {load0:.1f}->{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
