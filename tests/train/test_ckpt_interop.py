"""Export to safetensors / Hugging Face Llama and import back: logits match LlamaForCausalLM
(built from a config, nothing downloaded) and the round trip is exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from ckpt_helpers import cfg_of, job

from ndtrain.errors import NdtrainError
from ndtrain.model.llama import build_model
from ndtrain.train.checkpoint import load_model_weights, read_train_state
from ndtrain.tools.interop import export, import_hf
from ndtrain.train.trainer import train

transformers = pytest.importorskip("transformers")


def _ours(ckpt):
    weights, state = load_model_weights(ckpt)
    from ndtrain.config import from_dict

    model = build_model(from_dict(state["config"]).model, "cpu")
    model.load_state_dict(weights)
    return model.eval()


def _hf_logits(model_dir, tokens):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.timeout(180)
def test_export_matches_hf_llama_and_import_round_trips(parity_base, tmp_path, hang_deadline):
    # A trained (not freshly initialised) model, with GQA and a non-default RoPE theta.
    run = tmp_path / "run"
    summary = train(cfg_of(job(parity_base, run, train={"steps": 3}, model={"preset": "debug", "rope_theta": 5e5})))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "export", "--checkpoint", str(run), "--to", "hf", str(out)],
                          capture_output=True, text=True, timeout=hang_deadline(120))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 4
    with torch.no_grad():
        ours = _ours(summary["checkpoint"])(tokens)
    theirs = _hf_logits(out, tokens)
    # fp32, two implementations of one model: ~1e-7 relative per op over 4 layers on logits of ~1-10
    # (as derived in tests/model/test_generate.py); 1e-4 absolute is ~100x that.
    assert (ours - theirs).abs().max() <= 1e-4, (ours - theirs).abs().max()

    # Import that HF directory back: same weights bit for bit, same logits.
    ckpt = import_hf(out, tmp_path / "imported" / "checkpoints")
    assert read_train_state(ckpt)["kind"] == "weights"
    again, _ = load_model_weights(ckpt)
    original, _ = load_model_weights(summary["checkpoint"])
    assert all(torch.equal(again[k], original[k]) for k in original)

    # Fine-tuning from the imported weights: a fresh run (step 0) on them.
    ft = train(cfg_of(job(parity_base, tmp_path / "ft", train={"steps": 1}, model={"preset": "debug", "rope_theta": 5e5},
                          checkpoint={"resume": str(ckpt)})))
    assert ft["steps"] == 1


@pytest.mark.timeout(120)
def test_import_random_hf_model_with_tied_embeddings(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    src = tmp_path / "hf"
    hf.save_pretrained(str(src), safe_serialization=True)
    ckpt = import_hf(src, tmp_path / "ckpts")
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = _ours(ckpt)(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4

    flat = tmp_path / "flat.safetensors"
    export(ckpt, "safetensors", flat)
    from safetensors.torch import load_file

    tensors = load_file(str(flat))
    assert "output.weight" not in tensors and torch.equal(tensors["tok_embeddings.weight"],
                                                          hf.model.embed_tokens.weight.detach())


def test_import_refuses_what_it_cannot_represent(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    (src / "config.json").write_text(json.dumps({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(NdtrainError, match="RoPE scaling"):
        import_hf(src, tmp_path / "out")
    (src / "config.json").write_text(json.dumps(base))
    torch.save({"x": torch.zeros(1)}, src / "pytorch_model.bin")
    with pytest.raises(NdtrainError, match="pytorch_model.bin are pickle files"):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
