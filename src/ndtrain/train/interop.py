"""`ndtrain export` and `ndtrain import`: consolidated safetensors, and Hugging Face Llama.

Export reads any checkpoint (any layout, any world size) in one process and writes the full
weights. Our RoPE rotates half-split pairs, as Hugging Face's Llama does, so q/k weights need no
permutation: the mapping is names only. Import writes an ndtrain checkpoint of kind "weights"
(model only); `--checkpoint.resume` on it starts a fresh run (step 0, new optimizer) from those
weights, on any layout. Only safetensors are read: pickle-based `.bin` files are refused.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

from ndtrain.errors import NdtrainError
from ndtrain.model.config import ModelConfig

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


def hf_config(m: ModelConfig, dtype: str) -> dict:
    if m.is_moe:
        raise NdtrainError("Hugging Face Llama export covers dense models; this checkpoint is mixture-of-experts")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
        "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps, "max_position_embeddings": m.max_seq_len,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
        # Older transformers read rope_theta; 5.x reads rope_parameters.
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_theta": m.rope_theta, "rope_type": "default"},
        "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


def model_config_from_hf(c: dict) -> ModelConfig:
    if c.get("model_type") != "llama":
        raise NdtrainError(f"config.json has model_type {c.get('model_type')!r}; only 'llama' can be imported")
    rope = c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if c.get("rope_scaling") or rope_type != "default":
        raise NdtrainError(f"RoPE scaling {c.get('rope_scaling') or rope_type!r} is not implemented by ndtrain's "
                           f"model; importing would change the model's outputs")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise NdtrainError(f"config.json sets {key}=true; ndtrain's Llama has no biases")
    if c.get("hidden_act", "silu") != "silu":
        raise NdtrainError(f"hidden_act {c.get('hidden_act')!r} is not SwiGLU's silu")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise NdtrainError(f"head_dim {c['head_dim']} != hidden_size / num_attention_heads; not supported")
    m = ModelConfig(preset="debug", dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
                    n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
                    vocab_size=c["vocab_size"], rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                    norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings")),
                    max_seq_len=int(c.get("max_position_embeddings", 2048)),
                    init_std=float(c.get("initializer_range", 0.02)))
    problems = m.validate()
    if problems:
        raise NdtrainError(f"config.json describes an unsupported shape: {problems[0][1]}")
    return m


# ---- export --------------------------------------------------------------------------------
def export(checkpoint: str | Path, to: str, out: str | Path, dtype: str = "float32") -> Path:
    from safetensors.torch import save_file

    from ndtrain.config import from_dict
    from ndtrain.train.ckpt_store import load_model_weights
    from ndtrain.train.generate import resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    weights, state = load_model_weights(ckpt)
    cfg = from_dict(state["config"])
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = Path(out)
    if to == "safetensors":
        tensors = {k: v.to(torch_dtype).contiguous().clone() for k, v in weights.items()}
        if cfg.model.tie_embeddings:
            tensors.pop("output.weight", None)  # the same tensor as the embedding
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out), metadata={"format": "pt", "ndtrain_step": str(state["step"]),
                                               "ndtrain_config": json.dumps(state["config"])})
        return out
    tensors = {}
    for name, value in weights.items():
        if cfg.model.tie_embeddings and name == "output.weight":
            continue
        tensors[to_hf_name(name)] = value.to(torch_dtype).contiguous().clone()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(cfg.model, dtype), indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain export", description="Write a checkpoint's full weights, whatever "
                                "layout saved it, as one safetensors file or a Hugging Face Llama directory.")
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints/ or run directory")
    p.add_argument("--to", choices=["safetensors", "hf"], required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("out", help="OUT.safetensors (--to safetensors) or a directory (--to hf)")
    a = p.parse_args(argv)
    print(f"wrote {export(a.checkpoint, a.to, a.out, a.dtype)}")
    return 0


# ---- import --------------------------------------------------------------------------------
def read_hf(src: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    src = Path(src)
    if not (src / "config.json").is_file():
        raise NdtrainError(f"{src}: no config.json; expected a Hugging Face model directory")
    cfg = model_config_from_hf(json.loads((src / "config.json").read_text()))
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickles = [p.name for p in src.glob("*.bin")] + [p.name for p in src.glob("*.pt")]
        hint = f" ({', '.join(pickles)} are pickle files, which ndtrain never loads)" if pickles else ""
        raise NdtrainError(f"{src}: no model.safetensors{hint}; convert the weights to safetensors first")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(str(src / f)))
    tensors = {from_hf_name(k): v.float() for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    return cfg, tensors


def import_hf(src: str | Path, out_root: str | Path) -> Path:
    """Write `out_root/step_00000000/`, a published checkpoint of kind "weights"."""
    import torch.distributed.checkpoint as dcp

    from ndtrain.config import JobConfig, to_dict
    from ndtrain.model.llama import build_model
    from ndtrain.train.ckpt_store import (FORMAT, TRAIN_STATE, fsync_dir, step_name, write_manifest,
                                          write_marker)

    mcfg, tensors = read_hf(src)
    model = build_model(mcfg, "cpu")
    expected = set(model.state_dict())
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise NdtrainError(f"{src}: tensors do not match config.json (missing {missing[:3]}, unexpected {extra[:3]})")
    model.load_state_dict(tensors)  # shape checks
    out_root = Path(out_root)
    name = step_name(0)
    target, tmp = out_root / name, out_root / f".{name}.partial"
    if target.exists():
        raise NdtrainError(f"{target} already exists; choose another --out")
    tmp.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves without a process group: intended
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp), no_dist=True)
    job = JobConfig(name=f"import-{Path(src).name}")
    job.model = mcfg
    state = {"format": FORMAT, "version": 2, "kind": "weights", "step": 0, "tokens_seen": 0,
             "config": to_dict(job), "source": str(Path(src).resolve()), "saved_at": time.time()}
    (tmp / TRAIN_STATE).write_text(json.dumps(state, indent=1))
    write_manifest(tmp)
    write_marker(tmp, name)
    tmp.rename(target)
    fsync_dir(out_root)
    return target


def import_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain import", description="Create an ndtrain checkpoint from Hugging Face "
                                "Llama safetensors; train from it with --checkpoint.resume=<printed path>.")
    p.add_argument("--from", dest="fmt", choices=["hf"], required=True)
    p.add_argument("src", help="directory with config.json and model.safetensors (or a sharded index)")
    p.add_argument("--out", help="checkpoints directory to create (default runs/import-<name>/checkpoints)")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else Path("runs") / f"import-{Path(a.src).name}" / "checkpoints"
    path = import_hf(a.src, out)
    m = model_config_from_hf(json.loads((Path(a.src) / "config.json").read_text()))
    flags = " ".join(f"--model.{k}={str(getattr(m, k)).lower()}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                              "vocab_size", "rope_theta", "norm_eps", "tie_embeddings"))
    print(f"wrote {path}\ntrain from it with: ndtrain train {flags} --checkpoint.resume={path}")
    return 0
