"""`ndtrain import --from hf`'s reading of the weights: config.json is checked against the
safetensors headers (names, layer count, every shape) and the host's memory before anything is
allocated, then the model is filled tensor by tensor, one copy in fp32. A config.json that says
vocab_size 1e8 or num_hidden_layers 1e7 is one line naming the key, not a 25 GB allocation or a
hang building ten million layers."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ndtrain.errors import NdtrainError
from ndtrain.model.config import ModelConfig

# ndtrain's parameter names and Hugging Face Llama's, both ways (export and import use them).
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def to_hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise NdtrainError(f"parameter {name!r} has no Hugging Face Llama equivalent")


def from_hf_name(name: str) -> str:
    inverse_top = {v: k for k, v in _TOP.items()}
    if name in inverse_top:
        return inverse_top[name]
    inverse_layer = {v: k for k, v in _LAYER.items()}
    parts = name.split(".", 3)
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in inverse_layer:
        return f"layers.{parts[2]}.{inverse_layer[parts[3]]}"
    raise NdtrainError(f"Hugging Face tensor {name!r} is not part of a plain Llama model")



def headers(src: Path, files: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's (shape, file), ndtrain-named, from the safetensors headers alone: nothing is
    allocated for a tensor until its shape has been checked against config.json."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        try:
            with safe_open(str(src / f), framework="pt") as st:
                for key in st.keys():
                    if key.endswith("rotary_emb.inv_freq"):  # a cache some exports keep; RoPE is computed
                        continue
                    name = from_hf_name(key)
                    if name in out:
                        raise NdtrainError(f"{src / f}: tensor {key!r} is also in {out[name][1]}")
                    out[name] = (tuple(st.get_slice(key).get_shape()), f)
        except (SafetensorError, OSError, ValueError) as exc:
            raise NdtrainError(f"{src / f}: not a readable safetensors file ({exc})") from None
    return out


# The config.json keys that set each tensor's shape: named when a tensor disagrees with them.
_SHAPE_KEYS = {"tok_embeddings.weight": "vocab_size, hidden_size", "output.weight": "vocab_size, hidden_size",
               "norm.weight": "hidden_size", "attention.wq.weight": "num_attention_heads, hidden_size",
               "attention.wk.weight": "num_key_value_heads, hidden_size",
               "attention.wv.weight": "num_key_value_heads, hidden_size",
               "attention.wo.weight": "num_attention_heads, hidden_size",
               "feed_forward.w1.weight": "intermediate_size, hidden_size",
               "feed_forward.w3.weight": "intermediate_size, hidden_size",
               "feed_forward.w2.weight": "intermediate_size, hidden_size",
               "attention_norm.weight": "hidden_size", "ffn_norm.weight": "hidden_size"}
FP32 = 4


def check_hf_shapes(src: Path, cfg: ModelConfig, headers: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """config.json against the tensors the files hold, before anything is built: the layer count,
    the names, then every shape (from one layer built on the meta device: the model's own
    definition, no memory). Returns the fp32 bytes of the weights."""
    from ndtrain.model.llama import build_model

    layers = sorted({int(n.split(".")[1]) for n in headers if n.startswith("layers.")})
    if layers != list(range(cfg.n_layers)):
        held = f"{len(layers)} layer(s), numbered {layers[0]} to {layers[-1]}" if layers else "no layers"
        raise NdtrainError(f"{src}: config.json's num_hidden_layers is {cfg.n_layers} but the safetensors hold "
                           f"{held}")
    ref = {k: tuple(v.shape) for k, v in build_model(cfg, "meta", layers=[0]).state_dict().items()}
    if cfg.tie_embeddings:  # the head is the embedding's tensor: an lm_head in the files is not read
        ref.pop("output.weight")
        headers.pop("output.weight", None)
    generic = lambda n: n if not n.startswith("layers.") else "layers.0." + n.split(".", 2)[2]  # noqa: E731
    # Every layer's names (the count is the files' own, checked above, so this list stays small).
    expected = {k for k in ref if not k.startswith("layers.")} | {
        f"layers.{i}.{k.split('.', 2)[2]}" for i in layers for k in ref if k.startswith("layers.")}
    if set(headers) != expected:
        missing, extra = sorted(expected - set(headers)), sorted(set(headers) - expected)
        raise NdtrainError(f"{src}: tensors do not match config.json (missing "
                           f"{[to_hf_name(m) for m in missing[:3]]}, unexpected {[to_hf_name(e) for e in extra[:3]]})")
    for name in sorted(headers, key=lambda n: (n.startswith("layers."), n)):
        want, (got, f) = ref[generic(name)], headers[name]
        if got != want:
            key = _SHAPE_KEYS.get(name.split(".", 2)[2] if name.startswith("layers.") else name, "the shape keys")
            raise NdtrainError(f"{src / f}: tensor {to_hf_name(name)} has shape {list(got)} but config.json's "
                               f"{key} imply {list(want)}")
    return sum(math.prod(s) for s, _ in headers.values()) * FP32


def check_host_memory(src: Path, needed: int, available: int | None) -> None:
    """The import holds the weights in fp32 and one tensor in flight; refused in one line where
    that is more than this host has free (a config.json and files that say 400B parameters)."""
    def size(n: int) -> str:
        return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 1e6:,.1f} MB"

    if available is not None and needed > available:
        raise NdtrainError(f"{src}: importing needs about {size(needed)} of memory (the weights in fp32, as "
                           f"config.json's hidden_size, intermediate_size, num_hidden_layers and vocab_size "
                           f"give them), this host has {size(available)} available")


def load_hf(src: Path, cfg: ModelConfig, headers: dict) -> torch.nn.Module:
    """The model on the host in fp32, filled tensor by tensor from the files (one copy)."""
    from safetensors import SafetensorError, safe_open

    from ndtrain.model.llama import build_model

    model = build_model(cfg, "meta")
    model.to_empty(device="cpu")
    model.tie_weights()
    params = model.state_dict()
    by_file: dict[str, list[str]] = {}
    for name, (_, f) in headers.items():
        by_file.setdefault(f, []).append(name)
    with torch.no_grad():
        for f, names in sorted(by_file.items()):
            try:
                with safe_open(str(src / f), framework="pt") as st:
                    for name in names:
                        params[name].copy_(st.get_tensor(to_hf_name(name)))
            except (SafetensorError, OSError, ValueError) as exc:
                raise NdtrainError(f"{src / f}: not a readable safetensors file ({exc})") from None
    return model


