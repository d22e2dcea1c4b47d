"""FP8 training rules, torch-free: which Linear layers run their matmuls in float8, and which
layouts FP8 refuses. The runtime (parallel/float8.py) and the planner (planner/timing.py) both
call `converts`, so what is planned is what is trained.

A layer converts when all of these hold:
- it is a Linear of a decoder block whose forward goes through `nn.Linear.forward` (torchao swaps
  the module for `Float8Linear`): attention q/k/v/o and the dense SwiGLU w1/w2/w3. The output
  head stays bf16 (its logits feed the softmax, the most precision-sensitive matmul; every
  published fp8 recipe keeps it in high precision). In MoE layers the router (computed in fp32
  by design), the shared experts and the grouped experts read their weights directly, not
  through a Linear forward, so their GEMMs stay bf16;
- both its dimensions are multiples of 16 x tp. fp8 GEMMs (`torch._scaled_mm` on Hopper and
  later) need the inner and output dimensions to be multiples of 16; tensor parallel splits one
  of them by tp, so both are required to be multiples of 16 x tp: the local GEMM is then aligned
  whichever dimension the TP plan splits.

The third GEMM dimension of the weight gradient is the token count of a micro-batch
(micro_batch x seq_len / cp); `fp8_problems` asks for seq_len / cp to be a multiple of 16.
"""

from __future__ import annotations

ALIGN = 16  # fp8 GEMM dimensions must be multiples of this

# Linears inside MoE feed-forward layers: not converted (see the module docstring).
_MOE_FFN = ".feed_forward.router", ".feed_forward.shared_experts."


def converts(name: str, in_features: int, out_features: int, tp: int = 1) -> bool:
    """Whether the Linear called `name` (its canonical state-dict name, e.g. `layers.3.attention.wq`)
    with this global shape runs in fp8 under tensor-parallel degree `tp`."""
    if not name.startswith("layers."):
        return False  # the output head (and anything outside the decoder blocks)
    if any(part in name + "." for part in _MOE_FFN):
        return False
    step = ALIGN * tp
    return in_features % step == 0 and out_features % step == 0


def block_linears(model, layer: int) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every Linear of decoder layer `layer`, as the runtime
    model builds them (tests check the two agree). `model` is a ModelConfig."""
    d, hd = model.dim, model.dim // model.n_heads
    p = f"layers.{layer}."
    out = [(p + "attention.wq", d, model.n_heads * hd), (p + "attention.wk", d, model.n_kv_heads * hd),
           (p + "attention.wv", d, model.n_kv_heads * hd), (p + "attention.wo", model.n_heads * hd, d)]
    if model.is_moe_layer(layer):
        out.append((p + "feed_forward.router", d, model.n_experts))
        if model.n_shared_experts:
            h = model.n_shared_experts * model.expert_ffn_dim
            out += [(p + "feed_forward.shared_experts.w1", d, h), (p + "feed_forward.shared_experts.w2", h, d)]
            if model.mlp == "swiglu":
                out.append((p + "feed_forward.shared_experts.w3", d, h))
    else:
        f = model.ffn_dim
        out += [(p + "feed_forward.w1", d, f), (p + "feed_forward.w2", f, d)]
        if model.mlp == "swiglu":  # "gelu" is the planner's 2-matrix GPT MLP
            out.append((p + "feed_forward.w3", d, f))
    return out


def model_linears(model) -> list[tuple[str, int, int]]:
    """Every Linear of the model: the decoder blocks', then the output head."""
    out = [lin for i in range(model.n_layers) for lin in block_linears(model, i)]
    return out + [("output", model.dim, model.vocab_size)]


def fp8_linears(model, tp: int = 1) -> list[str]:
    """Names of the Linear layers that run in fp8."""
    return [n for n, i, o in model_linears(model) if converts(n, i, o, tp)]


def fp8_summary(model, tp: int = 1) -> str:
    """One line: which Linear layers run in fp8 and which stay bf16, grouped over layers."""
    groups: dict[bool, dict[str, int]] = {True: {}, False: {}}
    for n, i, o in model_linears(model):
        key = n.split(".", 2)[2] if n.startswith("layers.") else n
        side = groups[converts(n, i, o, tp)]
        side[key] = side.get(key, 0) + 1
    fmt = lambda g: ", ".join(f"{k} x{c}" if c > 1 else k for k, c in g.items()) or "none"
    experts = "; grouped experts: bf16" if model.is_moe else ""
    return f"fp8: {fmt(groups[True])}; bf16: {fmt(groups[False])}{experts}"


def fp8_matmul_fraction(model, tp: int = 1) -> float:
    """Share of a token's decoder-layer matmul FLOPs (routed experts: the active ones) that run in
    fp8. The planner's fp8 time model uses it; the head is priced apart, always in bf16."""
    fp8 = total = 0
    kinds: dict[bool, list[int]] = {}  # dense / MoE -> layer indices; layers of a kind share shapes
    for layer in range(model.n_layers):
        kinds.setdefault(model.is_moe_layer(layer), []).append(layer)
    for moe, layers in kinds.items():
        for n, i, o in block_linears(model, layers[0]):
            total += i * o * len(layers)
            fp8 += i * o * len(layers) if converts(n, i, o, tp) else 0
        if moe:  # grouped experts: bf16 (the runtime uses no fp8 grouped GEMM)
            mats = 3 if model.mlp == "swiglu" else 2
            total += mats * model.dim * model.expert_ffn_dim * model.n_active_experts * len(layers)
    return fp8 / total if total else 0.0


def _any_converts(model, tp: int) -> bool:
    """Whether fp8_linears(model, tp) is non-empty, checking one layer of each kind (dense, MoE):
    layers of a kind share their Linear shapes, and the head never converts. The planner asks
    this for every layout it searches, so it must not walk every layer."""
    firsts = {}
    for layer in range(model.n_layers):
        firsts.setdefault(model.is_moe_layer(layer), layer)
    return any(converts(n, i, o, tp) for layer in firsts.values() for n, i, o in block_linears(model, layer))


def fp8_problems(lay, model, seq_len: int | None = None) -> list[tuple[str, str]]:
    """(config key, one-line reason) for each way this fp8 layout cannot run; [] when it can (or
    when mixed precision is not fp8). `lay` is a resolved ndtrain.layout.Layout (mp, fp8_recipe,
    tp, cp), `model` a ModelConfig. layout.problems() runs this as one of its rules."""
    out = []  # fp8_recipe's vocabulary is the layout's (layout/rules.py values)
    if lay.mixed_precision != "fp8":
        return out
    tp, cp = lay.tp, lay.cp
    if not _any_converts(model, tp):
        out.append(("parallel.mixed_precision", f"fp8 would convert no Linear layer of this model: block "
                                                f"Linear dimensions must be multiples of {ALIGN} x tp = {ALIGN * tp}"))
    if seq_len and (seq_len // cp) % ALIGN:
        out.append(("data.seq_len", f"fp8 weight-gradient GEMMs need tokens per sequence shard (seq_len/cp = "
                                    f"{seq_len // cp}) to be a multiple of {ALIGN}"))
    return out
