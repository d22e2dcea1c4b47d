"""A Llama-3-style decoder in plain torch.nn.

It knows nothing about parallelism. Three choices keep it composable with every layout:
- `layers` is an `nn.ModuleDict` keyed by the original layer index, so a pipeline stage that
  deletes layers keeps the same parameter names and checkpoints reshard across layouts;
- RoPE angles are computed inside attention from explicit positions, so a sequence-sharded
  (SP/CP) or stage-split hidden state still gets its true global positions;
- the attention kernel is an attribute (`Attention.sdpa`) so context parallelism can swap in
  ring attention without the model importing it; it receives K/V with their own (fewer) heads
  and expands them itself;
- document masking (packed sequences): `doc_ids` [b, s] keeps attention inside each document
  and `positions` [b, s] restarts RoPE per document; both are plain inputs, so every layout
  passes them like any other tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ndtrain.model.config import ModelConfig
from ndtrain.model.feed_forward import FeedForward
from ndtrain.model.linear import Linear
from ndtrain.model.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 activations do not lose the mean-square.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, head_dim/2] (or [b, seq, head_dim/2] for per-row positions), in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, s, h, d] by half-split pairs (the Hugging Face Llama convention, so exported
    weights need no permutation)."""
    # chunk, not two slices: its backward is one cat, where each slice's backward zero-fills a
    # whole tensor, copies its half in and adds the two.
    x1, x2 = x.float().chunk(2, dim=-1)
    if cos.dim() == 2:  # one set of positions for every row
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)


def expand_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[b, h_kv, s, d] -> [b, n_heads, s, d]: each K/V head serves n_heads/h_kv consecutive query
    heads (grouped-query attention)."""
    rep = n_heads // t.shape[1]
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool: query i sees key j iff j <= i and both lie in the same document."""
    s = doc_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


# The dtypes bf16 CPU attention may run in: whichever the host probe measured faster
# (calibrate/host_probe.py), chosen per model by the runtime (set_cpu_bf16_attention).
CPU_BF16_ATTENTION = ("fp32", "bf16")


def plain_kernel(sdpa) -> bool:
    """`Attention.sdpa` is the model's own kernel (causal_sdpa, with or without its CPU bf16
    choice bound), not one a parallelism or the sampler put in its place."""
    return getattr(sdpa, "func", sdpa) is causal_sdpa


def set_cpu_bf16_attention(model: nn.Module, dtype: str) -> None:
    """Every Attention of `model` that runs the model's own kernel attends bf16 CPU inputs in
    `dtype` ("fp32" | "bf16"): a per-model kernel choice, like linear.set_cpu_kernel, made by the
    runtime from the host probe (calibrate/host_probe.py), which found either faster depending on
    the host and head size. fp32 unless told."""
    if dtype not in CPU_BF16_ATTENTION:
        raise ValueError(f"bf16 CPU attention runs in fp32 or bf16, got {dtype!r}")
    for module in model.modules():
        if isinstance(module, Attention) and plain_kernel(module.sdpa):
            module.sdpa = causal_sdpa if dtype == "fp32" else functools.partial(causal_sdpa, bf16_attends_in=dtype)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids=None,
                bf16_attends_in: str = "fp32") -> torch.Tensor:
    """q: [b, h, s, d]; k, v: [b, h_kv, s, d], not expanded, so a kernel that moves K/V (context
    parallel) moves h/h_kv times fewer bytes, and SDPA reads them as they are (`enable_gqa`): no
    [b, h, s, d] copy of K and V per layer (4x their memory and traffic at Llama 3's 32/8 heads).
    On CPU (torch 2.13) that sums dK/dV over each query group in another order than expanding did,
    within fp32 reassociation (<= 2.5e-7 of the largest gradient, tests/model/test_model.py), so
    CPU and CUDA share this path. With `doc_ids` [b, s] (or their doc_attention.DocumentMask),
    attention is block-causal."""
    from ndtrain.model import doc_attention

    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and bf16_attends_in == "fp32":
        # torch's CPU flash-attention kernel can be slower in bf16 than in fp32 (on the AMD host its
        # backward took ~1.5x the CPU time at head_dim 16, benchmarks/breakdown.py), which ate bf16's
        # matmul gain: attend in fp32 (more exact, too) and hand bf16 back, where the host probe found that faster.
        return causal_sdpa(q.float(), k.float(), v.float(), doc_ids).to(q.dtype)
    if doc_ids is not None and (isinstance(doc_ids, doc_attention.DocumentMask) or doc_attention.uses_flex(q.device)):
        # A dense [s, s] mask per row would not scale: flex attention skips masked blocks.
        return doc_attention.flex_document_attention(q, k, v, doc_ids)
    gqa = k.shape[1] != q.shape[1]
    if gqa and not doc_attention.fused_gqa(q, k):  # the math kernel would expand, and more
        k, v, gqa = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), False
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids), enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.sdpa = causal_sdpa

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank sees only its share of the heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.sdpa(q, k, v) if doc_ids is None else self.sdpa(q, k, v, doc_ids=doc_ids)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.feed_forward = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        from ndtrain.model.doc_attention import DocumentMask

        if isinstance(doc_ids, DocumentMask) and not plain_kernel(self.attention.sdpa):
            doc_ids = doc_ids.doc_ids  # another kernel (context parallel's) takes the plain ids
        # doc_ids by keyword: tensor parallel's input plan for attention lists (x, positions) only.
        h = x + self.attention(self.attention_norm(x), positions, doc_ids=doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Embedding -> blocks -> norm -> head. A pipeline stage sets the parts it does not own to
    None (and drops layers); forward then takes/returns hidden states instead of tokens/logits."""

    def __init__(self, cfg: ModelConfig, layers: list[int] | None = None, first: bool = True, last: bool = True):
        """`layers`, `first`, `last`: build only these layers, the embedding only if `first`, the
        final norm and head only if `last` (a pipeline stage); default the whole model."""
        super().__init__()
        if cfg.mlp != "swiglu":
            raise ValueError("the runtime model implements mlp='swiglu' only ('gelu' is a planner shape)")
        self.cfg = cfg
        self.tok_embeddings = _embedding(cfg.vocab_size, cfg.dim) if first else None
        ids = range(cfg.n_layers) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in ids})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if last else None
        self.output = Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """(Re)tie the head to the embedding; materialising from meta unties them."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        from ndtrain.model import doc_attention

        if (isinstance(doc_ids, torch.Tensor) and doc_attention.uses_flex(doc_ids.device)
                and any(isinstance(m, Attention) and plain_kernel(m.sdpa) for m in self.layers.modules())):
            # The flex block mask, once per micro-batch and outside the checkpointed blocks: every
            # layer and every recompute reuses it (doc_attention.DocumentMask).
            doc_ids = doc_attention.DocumentMask(doc_ids)
        for layer in self.layers.values():
            h = layer(h, positions, doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, but on the meta device without its N(0, 1) init: torch runs a meta tensor's
    normal_ through a decomposition that imports torch._dynamo (seconds on a slow CPU), which
    `generate` and `export` of a dense model otherwise never import. A meta weight holds no values
    to initialise; init.materialize() initialises every weight once it has memory."""
    if torch.empty(0).device.type == "meta":  # the device build_model constructs on
        return nn.Embedding.from_pretrained(torch.empty(rows, dim), freeze=False)
    return nn.Embedding(rows, dim)


def build_model(cfg: ModelConfig, device: str | torch.device = "meta", layers: list[int] | None = None,
                first: bool = True, last: bool = True) -> Transformer:
    """Construct on `device` (meta by default: no memory); call init.materialize() afterwards.
    `layers`/`first`/`last` build one pipeline stage (see Transformer)."""
    with torch.device(device):
        return Transformer(cfg, layers, first, last)
