"""FLOPs per token: the one count behind MFU in the trainer's metrics, the planner's MFU/HFU and
compute times, and the pipeline's FLOP-balanced stage split.

A layer's forward is 2 x (matmul parameters a token passes through: attention projections,
the MLP or the active experts, the router) plus the attention core, QK^T and softmax x V:
4 x heads x head_dim x s for the full s x s score matrix. Training is three forwards (the
backward is two), plus whatever activation checkpointing recomputes.

The attention convention is an explicit argument:
- "full" counts the whole s x s score matrix (PaLM's MFU definition, torch's FLOP counter for
  SDPA, Megatron-LM's formula). **MFU in ndtrain, in metrics and in the planner, uses "full"**
  (MFU_ATTENTION), and both say so in their output.
- "causal" counts the half a causal kernel computes (what Llama 3's reported TFLOP/s are
  consistent with; the planner's compute time uses it for flash kernels, which skip the
  masked half).
"""

from __future__ import annotations

from ndtrain.model.config import ModelConfig, layer_params

ATTENTION = ("full", "causal")
MFU_ATTENTION = "full"
MFU_CONVENTION = "MFU counts 6N + 12*L*heads*head_dim*seq FLOPs per token (full s x s attention, PaLM's convention)"


def _check(attention: str) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"attention convention must be one of {ATTENTION}, got {attention!r}")


def layer_matmul_params(cfg: ModelConfig, layer: int) -> int:
    """Matmul parameters a token passes through in one layer (active experts; norms excluded)."""
    return layer_params(cfg, layer, active_only=True) - 2 * cfg.dim


def attention_forward_flops(cfg: ModelConfig, seq: int, attention: str = MFU_ATTENTION) -> float:
    """Forward FLOPs of one layer's attention core (QK^T and softmax x V) per token."""
    _check(attention)
    full = 4 * cfg.n_heads * cfg.head_dim * seq
    return full / 2 if attention == "causal" else full


def layer_forward_flops(cfg: ModelConfig, layer: int, seq: int, attention: str = MFU_ATTENTION) -> float:
    return 2 * layer_matmul_params(cfg, layer) + attention_forward_flops(cfg, seq, attention)


def head_forward_flops(cfg: ModelConfig) -> float:
    """The output projection per token (the embedding is a lookup: no FLOPs)."""
    return 2 * cfg.vocab_size * cfg.dim


def forward_flops_per_token(cfg: ModelConfig, seq: int, attention: str = MFU_ATTENTION) -> float:
    layers = sum(layer_forward_flops(cfg, i, seq, attention) for i in range(cfg.n_layers))
    return layers + head_forward_flops(cfg)


def flops_per_token(cfg: ModelConfig, seq: int, attention: str = MFU_ATTENTION) -> float:
    """Training FLOPs per token (forward + backward = 3 forwards), nothing recomputed:
    6 N_matmul + 12 L heads head_dim s for "full" attention, half the last term for "causal"."""
    return 3 * forward_flops_per_token(cfg, seq, attention)


def recompute_flops_per_token(cfg: ModelConfig, seq: int, ac: str, attention: str = MFU_ATTENTION,
                              flash: bool = True, every: int = 2) -> float:
    """Forward FLOPs activation checkpointing repeats per token. `full` recomputes every layer,
    `every_n` every `every`-th; `selective` recomputes elementwise ops only, plus the attention
    scores when the kernel stores them (unfused attention; flash kernels recompute them anyway)."""
    if ac == "none":
        return 0.0
    if ac == "selective":
        return 0.0 if flash else cfg.n_layers * attention_forward_flops(cfg, seq, attention)
    layers = range(0, cfg.n_layers, every) if ac == "every_n" else range(cfg.n_layers)
    return sum(layer_forward_flops(cfg, i, seq, attention) for i in layers)


def average_layer_forward_flops(cfg: ModelConfig, seq: int, attention: str) -> tuple[float, float]:
    """(matmul, attention core) forward FLOPs per token of an average layer (MoE layers and dense
    ones averaged), for cost models that treat layers alike."""
    mm = 2 * sum(layer_matmul_params(cfg, i) for i in range(cfg.n_layers)) / cfg.n_layers
    return mm, attention_forward_flops(cfg, seq, attention)


def shown_fraction(ratio) -> float | None:
    """A fraction of a peak (MFU) as ndtrain shows it, or None: above 1 no run outpaces a true
    peak, so the peak is wrong (a misidentified device, a measured probe below what the run
    reaches) and the figure would mislead. The step line, metrics.jsonl and `ndtrain report`
    (which also reads rows older ndtrains wrote) all go through this one rule."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        return None
    return ratio


def mfu(flops_per_s: float, peak: float) -> float | None:
    """Model FLOP/s over the peak, through shown_fraction."""
    return shown_fraction(flops_per_s / peak if peak > 0 else float("inf"))
