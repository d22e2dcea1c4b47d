"""Model shapes for the planner: presets, `--model-shape` strings, GPT shapes of published tables,
and the per-layer quantities (parameters, FLOPs, activation widths) the memory and time models use.
Also the number parsers the CLI shares (token counts, durations)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ndtrain.errors import NdtrainError
from ndtrain.model.config import PRESETS, ModelConfig, attention_params, num_params, preset

# `--model-shape` key -> (ModelConfig field, type)
SHAPE_KEYS = {
    "layers": ("n_layers", int), "hidden": ("dim", int), "dim": ("dim", int), "heads": ("n_heads", int),
    "kv_heads": ("n_kv_heads", int), "ffn": ("ffn_dim", int), "vocab": ("vocab_size", int),
    "mlp": ("mlp", str), "tie": ("tie_embeddings", bool), "experts": ("n_experts", int),
    "active_experts": ("n_active_experts", int), "shared_experts": ("n_shared_experts", int),
    "expert_ffn": ("expert_ffn_dim", int), "dense_layers": ("moe_dense_layers", int),
}


def _check(cfg: ModelConfig) -> ModelConfig:
    errs = cfg.validate()
    if errs:
        raise NdtrainError("; ".join(f"{k}: {msg}" for k, msg in errs))
    return cfg


def parse_model_shape(text: str) -> ModelConfig:
    """`layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,vocab=128256,mlp=swiglu`.

    Omitted keys default to the GPT convention where that is unambiguous (kv_heads = heads,
    ffn = 4*hidden for gelu or the Llama 8/3 rounding for swiglu) and vocab = 128256.
    """
    fields: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SHAPE_KEYS:
            raise NdtrainError(f"--model-shape: bad item {item!r}; keys are {', '.join(SHAPE_KEYS)}")
        name, typ = SHAPE_KEYS[key]
        try:
            if typ is bool:
                fields[name] = value.strip().lower() in ("1", "true", "yes")
            elif typ is int:
                fields[name] = int(parse_count(value))
            else:
                fields[name] = value.strip().lower()
        except ValueError as exc:
            raise NdtrainError(f"--model-shape: {key}={value!r} is not a number") from exc
    for required in ("n_layers", "dim", "n_heads"):
        if required not in fields:
            raise NdtrainError(f"--model-shape needs {', '.join(k for k, (f, _) in SHAPE_KEYS.items() if f == required)}=")
    fields.setdefault("mlp", "swiglu")
    fields.setdefault("n_kv_heads", fields["n_heads"])
    fields.setdefault("vocab_size", 128256)
    if "ffn_dim" not in fields:
        h = fields["dim"]
        fields["ffn_dim"] = 4 * h if fields["mlp"] == "gelu" else 256 * -(-(8 * h // 3) // 256)
    fields["max_seq_len"] = 1 << 20
    return _check(ModelConfig(preset="custom", **fields))


def gpt_shape(hidden: int, layers: int, heads: int, vocab: int = 51200) -> ModelConfig:
    """The GPT shape of Megatron-LM's tables: 2-matrix GeLU MLP of 4h, multi-head attention,
    tied embeddings (biases and learned positions are below 0.1% of parameters and ignored)."""
    return _check(ModelConfig(preset="custom", dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                              ffn_dim=4 * hidden, vocab_size=vocab, mlp="gelu", tie_embeddings=True,
                              max_seq_len=1 << 20))


def resolve_model(name: str | None, shape: str | None) -> ModelConfig:
    if shape:
        return parse_model_shape(shape)
    if not name:
        raise NdtrainError("give --model PRESET or --model-shape layers=..,hidden=..,heads=..")
    if name not in PRESETS:
        raise NdtrainError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = preset(name)
    cfg.max_seq_len = 1 << 20  # planning is about cost, not about the RoPE range the preset was trained for
    return cfg


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """Per-layer averages of a model, precomputed once so that evaluating a layout is arithmetic."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_act_width: float  # stored MLP intermediate width per token, averaged over layers
    mm_params_layer: float  # matmul parameters a token passes through, per layer (active experts)
    attn_params_layer: int
    dense_params_layer: float  # non-expert parameters per layer (attention, dense MLP, shared, router)
    expert_params_layer: float  # routed expert parameters per layer (all experts), average
    moe_dense_params_layer: float  # of dense_params_layer, the MoE layers' shared experts and router (replicated over tp)
    mm_moe_layer: float  # of mm_params_layer, the MoE part (router, shared, active routed experts): replicated over tp
    moe_layer_frac: float
    active_experts: int
    n_experts: int
    embed_params: int  # one vocab x dim matrix
    tied: bool
    total_params: int
    gelu: bool

    @property
    def gqa_ratio(self) -> float:
        return self.kv_heads / self.heads


@lru_cache(maxsize=64)
def _shape(key: tuple) -> Shape:
    cfg = ModelConfig(**dict(key))
    L, h = cfg.n_layers, cfg.dim
    n_mlp_mats = 3 if cfg.mlp == "swiglu" else 2
    attn = attention_params(cfg)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
    n_dense = L - n_moe
    dense_mlp = n_mlp_mats * h * cfg.ffn_dim
    expert = n_mlp_mats * h * cfg.expert_ffn_dim
    shared = cfg.n_shared_experts * expert + h * cfg.n_experts  # shared experts + router stay dense
    dense_per_layer = attn + 2 * h + (n_dense * dense_mlp + n_moe * shared) / L
    routed_per_layer = n_moe * cfg.n_experts * expert / L
    mm = attn + (n_dense * dense_mlp + n_moe * (shared + cfg.n_active_experts * expert)) / L
    width = (n_dense * cfg.ffn_dim + n_moe * (cfg.n_active_experts + cfg.n_shared_experts) * cfg.expert_ffn_dim) / L
    return Shape(layers=L, dim=h, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                 vocab=cfg.vocab_size, mlp_act_width=width, mm_params_layer=mm, attn_params_layer=attn,
                 dense_params_layer=dense_per_layer, expert_params_layer=routed_per_layer,
                 moe_dense_params_layer=n_moe * shared / L,
                 mm_moe_layer=n_moe * (shared + cfg.n_active_experts * expert) / L,
                 moe_layer_frac=n_moe / L, active_experts=cfg.n_active_experts, n_experts=cfg.n_experts,
                 embed_params=cfg.vocab_size * h, tied=cfg.tie_embeddings, total_params=num_params(cfg),
                 gelu=cfg.mlp == "gelu")


def shape_of(cfg: ModelConfig) -> Shape:
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings", "mlp",
            "n_experts", "n_active_experts", "n_shared_experts", "expert_ffn_dim", "moe_dense_layers")
    return _shape(tuple((k, getattr(cfg, k)) for k in keys))


# ---------------------------------------------------------------------------------------------
# Numbers on the command line.

_SUFFIX = {"k": 1, "m": 2, "g": 3, "b": 3, "t": 4, "p": 5}


def parse_count(text: str | int | float, binary: bool = False) -> float:
    """`15T` -> 15e12, `1.5B` -> 1.5e9; with binary=True `16M` -> 16 * 2**20 (batch sizes in
    tokens are powers of two in practice: Llama 3's "16M" is 2048 x 8192 = 16,777,216)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgbtp]?)i?\s*", text.lower())
    if not m:
        raise ValueError(f"not a count: {text!r}")
    value, suffix = float(m.group(1)), m.group(2)
    if suffix:
        value *= (1024 if binary else 1000) ** _SUFFIX[suffix]
    return value


def parse_duration(text: str | int | float) -> float:
    """Seconds from `90`, `90s`, `5m`, `2h`, `1.5d`."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|sec|m|min|h|d)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 5m, 2h)")
    scale = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[m.group(2)]
    return float(m.group(1)) * scale
