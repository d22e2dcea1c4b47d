"""Model shapes: one dataclass, named presets, exact parameter counts (FLOPs per token are
ndtrain.layout.flops', built on these counts).

Pure Python (no torch import) so that the planner can use it on a laptop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Kernels the model's Linear layers can run their CPU fp32 matmuls through (model/linear.py),
# chosen by `[parallel] cpu_matmul`; here, torch-free, so the layout rules can check the name.
CPU_MATMUL_KERNELS = ("onednn", "blas")


@dataclass
class ModelConfig:
    preset: str = "debug"
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 192
    vocab_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    init_std: float = 0.02
    # "swiglu" (Llama) or "gelu" (GPT, 2-matrix MLP); the runtime model implements swiglu only,
    # gelu exists so the planner can describe the shapes of Megatron's published tables.
    mlp: str = "swiglu"
    # Mixture of experts (0 experts = dense). Layers [0, moe_dense_layers) stay dense.
    n_experts: int = 0
    n_active_experts: int = 0
    n_shared_experts: int = 0
    expert_ffn_dim: int = 0
    moe_dense_layers: int = 0
    router: str = "softmax"  # softmax | sigmoid
    load_balance: str = "aux_loss"  # aux_loss | aux_free | none
    aux_loss_coef: float = 0.01
    aux_free_update_rate: float = 0.001
    capacity_factor: float = 0.0  # 0 = no capacity limit, no dropped tokens

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.moe_dense_layers

    def validate(self) -> list[tuple[str, str]]:
        """Returns (key, problem) pairs; empty when the shape is buildable."""
        errs = []
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, key) <= 0:
                errs.append((f"model.{key}", f"must be positive, got {getattr(self, key)}"))
        for key in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, key) > 0:  # also false for nan
                errs.append((f"model.{key}", f"must be positive, got {getattr(self, key)}"))
        for key in ("n_experts", "n_active_experts", "n_shared_experts", "expert_ffn_dim", "moe_dense_layers",
                    "aux_loss_coef", "aux_free_update_rate", "capacity_factor"):
            if not getattr(self, key) >= 0:
                errs.append((f"model.{key}", f"must be >= 0, got {getattr(self, key)}"))
        if errs:
            return errs
        if self.dim % self.n_heads:
            errs.append(("model.n_heads", f"dim {self.dim} is not divisible by n_heads {self.n_heads}"))
        elif self.head_dim % 2:
            errs.append(("model.n_heads", f"head_dim {self.head_dim} must be even for RoPE"))
        if self.n_heads % self.n_kv_heads:
            errs.append(("model.n_kv_heads", f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"))
        if self.mlp not in ("swiglu", "gelu"):
            errs.append(("model.mlp", f"must be 'swiglu' or 'gelu', got {self.mlp!r}"))
        if self.is_moe:
            if not 0 < self.n_active_experts <= self.n_experts:
                errs.append(("model.n_active_experts", f"must be in [1, n_experts={self.n_experts}]"))
            if self.expert_ffn_dim <= 0:
                errs.append(("model.expert_ffn_dim", "must be positive for a mixture-of-experts model"))
            if self.router not in ("softmax", "sigmoid"):
                errs.append(("model.router", f"must be 'softmax' or 'sigmoid', got {self.router!r}"))
            if self.load_balance not in ("aux_loss", "aux_free", "none"):
                errs.append(("model.load_balance", f"must be aux_loss, aux_free or none, got {self.load_balance!r}"))
            if self.capacity_factor < 0:
                errs.append(("model.capacity_factor", "must be >= 0 (0 disables capacity dropping)"))
        return errs


# The model keys that change the function the weights compute: a resume refuses any change to
# them (train/checkpoint/store.py), so continuing a run can never silently compute something else.
# ARCHITECTURE_KEYS also decide which tensors exist or their shapes (or, n_heads, how they are
# split into heads): no switch allows changing them. The rest may change when the user lists
# them in `checkpoint.allow_model_change` (a fine-tune: a longer context's rope_theta, say).
# Left out, as they leave that function alone: preset (a name; its values are compared),
# max_seq_len (the RoPE table's length: positions both cover get the same angles), init_std
# (initialisation only), aux_loss_coef and aux_free_update_rate (the training signal only).
ARCHITECTURE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "mlp", "tie_embeddings",
                     "n_experts", "n_shared_experts", "expert_ffn_dim", "moe_dense_layers")
FUNCTION_KEYS = (*ARCHITECTURE_KEYS, "rope_theta", "norm_eps", "n_active_experts", "router", "load_balance",
                 "capacity_factor")


PRESETS: dict[str, dict] = {
    # Tests: 4 layers so pp=4 splits evenly, 4 kv-heads so tp=4 shards GQA.
    "debug": dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=192, vocab_size=256),
    "tiny": dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=8192),
    "small": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=32000),
    # Published Llama 3 / 3.2 shapes.
    "llama3-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                      rope_theta=500000.0, tie_embeddings=True, max_seq_len=131072),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                      rope_theta=500000.0, max_seq_len=131072),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                       rope_theta=500000.0, max_seq_len=131072),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256,
                        rope_theta=500000.0, max_seq_len=131072),
    # Mixture of experts.
    "debug-moe": dict(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=192, vocab_size=256,
                      n_experts=8, n_active_experts=2, n_shared_experts=1, expert_ffn_dim=64, moe_dense_layers=1),
    # Mixtral 8x7B: 32 layers, 8 experts, top-2, expert FFN 14336, no shared expert.
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                         rope_theta=1e6, max_seq_len=32768, n_experts=8, n_active_experts=2,
                         expert_ffn_dim=14336),
    # DeepSeek-V3-like: 61 layers (3 dense), 256 routed experts top-8 + 1 shared, expert FFN 2048,
    # sigmoid router with aux-loss-free balancing. Attention is modelled as GQA-free MHA (no MLA).
    "deepseek-v3": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432, vocab_size=129280,
                        rope_theta=10000.0, max_seq_len=131072, n_experts=256, n_active_experts=8,
                        n_shared_experts=1, expert_ffn_dim=2048, moe_dense_layers=3, router="sigmoid",
                        load_balance="aux_free"),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **overrides}
    return ModelConfig(preset=name, **fields)


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(cfg, **changes)


# ---------------------------------------------------------------------------------------------
# Counting. These closed forms are what the runtime model must match exactly (tests check it).


def _mlp_params(dim: int, ffn: int, mlp: str) -> int:
    return (3 if mlp == "swiglu" else 2) * dim * ffn


def attention_params(cfg: ModelConfig) -> int:
    hd = cfg.head_dim
    return cfg.dim * cfg.n_heads * hd * 2 + cfg.dim * cfg.n_kv_heads * hd * 2


def layer_params(cfg: ModelConfig, layer: int, active_only: bool = False) -> int:
    """Parameters of one decoder layer (norm weights included)."""
    norms = 2 * cfg.dim
    if not cfg.is_moe_layer(layer):
        return attention_params(cfg) + _mlp_params(cfg.dim, cfg.ffn_dim, cfg.mlp) + norms
    routed = cfg.n_active_experts if active_only else cfg.n_experts
    experts = (routed + cfg.n_shared_experts) * _mlp_params(cfg.dim, cfg.expert_ffn_dim, cfg.mlp)
    router = cfg.dim * cfg.n_experts
    return attention_params(cfg) + experts + router + norms


def num_params(cfg: ModelConfig, active_only: bool = False) -> int:
    """Exact parameter count (total, or active per token for MoE)."""
    embed = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    layers = sum(layer_params(cfg, i, active_only) for i in range(cfg.n_layers))
    return embed + head + layers + cfg.dim  # + final norm
