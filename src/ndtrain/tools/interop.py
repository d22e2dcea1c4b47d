"""`ndtrain export` and `ndtrain import`: consolidated safetensors, and Hugging Face Llama.

Export reads any checkpoint (any layout, any world size) in one process and writes the full
weights. Our RoPE rotates half-split pairs, as Hugging Face's Llama does, so q/k weights need no
permutation: the mapping is names only. Import writes an ndtrain checkpoint of kind "weights"
(model only); `--checkpoint.resume` on it starts a fresh run (step 0, new optimizer) from those
weights, on any layout. Only safetensors are read: pickle-based `.bin` files are refused.

torch (and hf_weights, which needs it) is imported inside the functions that use it, so `ndtrain
export` refuses a bad argument, an existing output or a missing checkpoint before importing torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
import warnings
from pathlib import Path

from ndtrain.errors import NdtrainError
from ndtrain.model.config import ModelConfig

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


def _hf_field(c: dict, key: str, kind: str, required: bool = False, default=None):
    """One config.json field, type-checked: 'int' (positive integer), 'num' (finite positive
    number), 'bool', 'str' or 'dict'."""
    if key not in c or c[key] is None:
        if required:
            raise NdtrainError(f"config.json lacks {key!r}; not a Hugging Face Llama config")
        return default
    v = c[key]
    ok = {"int": lambda: isinstance(v, int) and not isinstance(v, bool) and v > 0,
          "num": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
          "bool": lambda: isinstance(v, bool), "str": lambda: isinstance(v, str),
          "dict": lambda: isinstance(v, dict)}[kind]()
    if not ok:
        what = {"int": "a positive integer", "num": "a finite positive number", "bool": "true or false",
                "str": "a string", "dict": "an object"}[kind]
        raise NdtrainError(f"config.json: {key!r} must be {what}, got {str(v)[:60]!r}")
    return v


def model_config_from_hf(c: dict) -> ModelConfig:
    if not isinstance(c, dict):
        raise NdtrainError(f"config.json holds a {type(c).__name__}, not an object; not a Hugging Face config")
    if _hf_field(c, "model_type", "str") != "llama":
        raise NdtrainError(f"config.json has model_type {c.get('model_type')!r}; only 'llama' can be imported")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        _hf_field(c, key, "int", required=True)
    for key in ("num_key_value_heads", "max_position_embeddings", "head_dim"):
        _hf_field(c, key, "int")
    for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
        _hf_field(c, key, "num")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        _hf_field(c, key, "bool")
    _hf_field(c, "hidden_act", "str")
    _hf_field(c, "rope_parameters", "dict")
    if isinstance(c.get("rope_parameters"), dict):
        _hf_field(c["rope_parameters"], "rope_theta", "num")
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
def hf_tokenizer_files(tok, max_len: int) -> dict[str, bytes]:
    """The files a Hugging Face directory loads a BPE tokenizer from: ndtrain's tokenizer.json as
    it is (it is the `tokenizers` library's format) and a tokenizer_config.json that names its
    end-of-document token, so AutoTokenizer reads the same ids ndtrain trained on."""
    from ndtrain.data.tokenizer import EOT

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.file_bytes, "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def _export_tokenizer(ckpt: Path, cfg, state: dict):
    """A BPE checkpoint's tokenizer (the checkpoint's copy, else its corpus's; one line when
    neither is there); None for the byte tokenizer, which no Hugging Face file describes, and
    for imported weights, which record no data."""
    from ndtrain.train.generate import checkpoint_tokenizer, recorded_tokenizer

    return checkpoint_tokenizer(cfg, state, ckpt) if recorded_tokenizer(state) == "bpe" else None


def _eos_id(tok, state: dict) -> int | None:
    """The id `ndtrain generate` stops at: its tokenizer's end of document (byte: 255, no file
    describes that tokenizer, its name does). None only for imported weights, which record no
    data: config.json then says null, not a default of Hugging Face's that is some other token."""
    from ndtrain.data.tokenizer import ByteTokenizer
    from ndtrain.train.generate import recorded_tokenizer

    if tok is not None:
        return tok.eos_id
    return ByteTokenizer.eos_id if recorded_tokenizer(state) == "byte" else None


def check_new_output(out: Path, what: str) -> None:
    """`out` must not exist yet (or be an empty directory, for --to hf) and must be creatable:
    an export never overwrites a file the user already has."""
    from ndtrain.paths import check_creatable

    out = Path(out)
    if out.is_dir() and what == "dir" and not any(out.iterdir()):
        check_creatable(out, "OUT")
        return
    if out.exists() or out.is_symlink():
        raise NdtrainError(f"{out} already exists; ndtrain never overwrites it: choose another output path or "
                           f"remove it first")
    check_creatable(out.parent, "OUT")


def _publish(tmp: Path, out: Path) -> None:
    """The finished temporary file or directory takes the output's name in one rename."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    os.replace(tmp, out)


def follow_umask(path: Path) -> None:
    """Give `path` the mode any new file gets (0666 less the umask). safetensors 0.8 writes
    through a temporary file of mode 0600 that it renames into place (safetensors#782), so an
    export's weights were readable by their owner alone where its config.json is group-readable:
    on a shared cluster the group could not load them."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (os.umask can only set
    it, and a moment of umask 0 would let another thread create a world-writable file)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the strictest value while it is read: nothing made meanwhile is exposed
    os.umask(mask)
    return mask


def _write_failed(exc: OSError, out: Path, tmp: Path, needed: int):
    from ndtrain.errors import RunError

    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path(".")).free
    return RunError(f"cannot write {out}: {exc.strerror or exc} (it needs about {needed / 1e6:,.1f} MB, "
                    f"{free / 1e6:,.1f} MB free); nothing was written")


def export(checkpoint: str | Path, to: str, out: str | Path, dtype: str = "float32") -> Path:
    from ndtrain.train.generate import resolve_checkpoint

    out = Path(out)
    check_new_output(out, "file" if to == "safetensors" else "dir")
    ckpt = resolve_checkpoint(checkpoint)
    import torch
    from safetensors.torch import save_file

    from ndtrain.train.checkpoint import checkpoint_config, load_model_weights
    from ndtrain.tools.hf_weights import to_hf_name

    weights, state = load_model_weights(ckpt)
    cfg = checkpoint_config(ckpt, state)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if to == "safetensors":
        tensors = {k: v.to(torch_dtype).contiguous().clone() for k, v in weights.items()}
        if cfg.model.tie_embeddings:
            tensors.pop("output.weight", None)  # the same tensor as the embedding
        meta = {"format": "pt", "ndtrain_step": str(state["step"]), "ndtrain_config": json.dumps(state["config"])}
    else:
        hf_cfg = hf_config(cfg.model, dtype)
        tok = _export_tokenizer(ckpt, cfg, state)
        tok_files = hf_tokenizer_files(tok, cfg.model.max_seq_len) if tok is not None else {}
        hf_cfg["eos_token_id"] = _eos_id(tok, state)
        tensors = {to_hf_name(name): value.to(torch_dtype).contiguous().clone() for name, value in weights.items()
                   if not (cfg.model.tie_embeddings and name == "output.weight")}
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if to == "safetensors":
            save_file(tensors, str(tmp), metadata=meta)
            follow_umask(tmp)
        else:
            tmp.mkdir()
            (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
            for name, data in tok_files.items():
                (tmp / name).write_bytes(data)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            follow_umask(tmp / "model.safetensors")
        _publish(tmp, out)
    except OSError as exc:
        raise _write_failed(exc, out, tmp, needed) from None
    except Exception as exc:  # safetensors reports I/O failures as its own error type
        if "No space left" in str(exc) or "I/O error" in str(exc):
            raise _write_failed(OSError(str(exc).split(":")[-1].strip()), out, tmp, needed) from None
        raise
    return out


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="ndtrain export", description="Write a checkpoint's full weights, whatever "
                                "layout saved it, as one safetensors file or a Hugging Face Llama directory.")
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints/ or run directory")
    p.add_argument("--to", choices=["safetensors", "hf"], required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("out", help="OUT.safetensors (--to safetensors) or a directory (--to hf); must not exist")
    a = p.parse_args(argv)
    print(f"wrote {export(a.checkpoint, a.to, a.out, a.dtype)}")
    return 0


# ---- import --------------------------------------------------------------------------------
def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise NdtrainError(f"{path}: not readable JSON ({exc})") from None


def _weight_files(src: Path) -> list[str]:
    """The safetensors files of a Hugging Face directory (one, or the shards of an index)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") if isinstance(_read_json(index), dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise NdtrainError(f"{index}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        for f in files:
            if Path(f).is_absolute() or ".." in Path(f).parts or not (src / f).is_file():
                raise NdtrainError(f"{index}: shard {f!r} is not a file inside {src}")
        return files
    if (src / "model.safetensors").is_file():
        return ["model.safetensors"]
    pickles = [p.name for p in src.glob("*.bin")] + [p.name for p in src.glob("*.pt")]
    hint = f" ({', '.join(pickles)} are pickle files, which ndtrain never loads)" if pickles else ""
    raise NdtrainError(f"{src}: no model.safetensors{hint}; convert the weights to safetensors first")


def read_hf(src: str | Path) -> tuple[ModelConfig, dict[str, tuple[tuple[int, ...], str]], int]:
    """(model config, each tensor's (shape, file), fp32 bytes): checked, nothing loaded yet."""
    src = Path(src)
    if not src.is_dir():
        raise NdtrainError(f"{src}: {'no such directory' if not src.exists() else 'not a directory'}; expected a "
                           f"Hugging Face model directory")
    if not (src / "config.json").is_file():
        raise NdtrainError(f"{src}: no config.json; expected a Hugging Face model directory")
    from ndtrain.tools import hf_weights

    cfg = model_config_from_hf(_read_json(src / "config.json"))
    headers = hf_weights.headers(src, _weight_files(src))
    return cfg, headers, hf_weights.check_hf_shapes(src, cfg, headers)


def import_hf(src: str | Path, out_root: str | Path) -> Path:
    """Write `out_root/step_00000000/`, a published checkpoint of kind "weights"."""
    import torch.distributed.checkpoint as dcp

    from ndtrain.config import JobConfig, to_dict
    from ndtrain.paths import check_creatable
    from ndtrain.tools import hf_weights
    from ndtrain.train.checkpoint import (CHECKPOINT_FORMAT, TRAIN_STATE, fsync_dir, step_name, write_manifest,
                                          write_marker)
    from ndtrain.train import host_memory

    out_root = Path(out_root)
    name = step_name(0)
    target, tmp = out_root / name, out_root / f".{name}.partial"
    if target.exists():
        raise NdtrainError(f"{target} already exists; choose another --out")
    if out_root.is_dir() and any(p.name.startswith(("step_", ".step_")) for p in out_root.iterdir()):
        raise NdtrainError(f"--out {out_root} already holds checkpoints (another run's?); import into a new directory")
    check_creatable(out_root, "--out")
    mcfg, headers, needed = read_hf(src)
    largest = max(math.prod(s) for s, _ in headers.values()) * hf_weights.FP32
    hf_weights.check_host_memory(Path(src), needed + largest, host_memory.available_bytes())
    model = hf_weights.load_hf(Path(src), mcfg, headers)
    created = [d for d in [out_root, *out_root.parents] if not d.exists()]
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns that it saves without a process group: intended
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp), no_dist=True)
        job = JobConfig(name=f"import-{Path(src).name}")
        job.model = mcfg
        state = {"format": CHECKPOINT_FORMAT, "version": 2, "kind": "weights", "step": 0, "tokens_seen": 0,
                 "config": to_dict(job), "source": str(Path(src).resolve()), "saved_at": time.time()}
        (tmp / TRAIN_STATE).write_text(json.dumps(state, indent=1))
        write_manifest(tmp)
        write_marker(tmp, name)
        tmp.rename(target)
        fsync_dir(out_root)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(tmp, ignore_errors=True)
        for d in sorted(created, key=lambda d: len(d.parts), reverse=True):  # only what this call created
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        from ndtrain.errors import RunError

        needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        raise RunError(f"cannot write the imported checkpoint to {out_root}: {str(exc).splitlines()[-1][:200]} "
                       f"(it needs about {needed / 1e6:,.1f} MB); nothing was written") from None
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
