"""`ndtrain import --from hf` checks config.json against the safetensors headers (names, layer
count, every shape) and the host's memory before it allocates anything, and `ndtrain export`'s
files follow the umask like every other file (safetensors 0.8 writes them 0600)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from ndtrain.errors import NdtrainError
from ndtrain.model import llama
from ndtrain.model.config import ModelConfig
from ndtrain.train import host_memory
from ndtrain.tools.hf_weights import to_hf_name
from ndtrain.tools.interop import export, hf_config, import_hf

pytestmark = pytest.mark.timeout(120)


def _hf_dir(tmp_path, **config_edits):
    """A small Llama as a Hugging Face directory, written without transformers; config.json
    then edited (what a user's download might say)."""
    from safetensors.torch import save_file

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128)
    torch.manual_seed(0)
    tensors = {to_hf_name(k): torch.randn(v.shape) for k, v in llama.build_model(cfg, "meta").state_dict().items()}
    src = tmp_path / "hf"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({**hf_config(cfg, "float32"), **config_edits}))
    return src, tensors


@pytest.fixture
def no_big_allocation(monkeypatch):
    """Fails the test if anything builds a model off the meta device whose weights alone would
    exceed 1 GB, or with more than 1,000 layers: what the checks must refuse first."""
    real = llama.build_model

    def guarded(cfg, device="meta", *args, **kwargs):
        if str(device) != "meta" and (cfg.vocab_size * cfg.dim * 4 > 1e9 or cfg.n_layers > 1000
                                      or cfg.ffn_dim * cfg.dim * 4 > 1e9):
            raise AssertionError(f"built {cfg} on {device} before checking it against the files")
        return real(cfg, device, *args, **kwargs)

    monkeypatch.setattr(llama, "build_model", guarded)


@pytest.mark.parametrize("edit, key", [
    ({"vocab_size": 100_000_000}, "vocab_size"),  # before: 25.6 GB allocated for the embedding
    ({"num_hidden_layers": 10_000_000}, "num_hidden_layers"),  # before: a hang building 1e7 layers
    ({"intermediate_size": 50_000_000}, "intermediate_size"),
    ({"num_hidden_layers": 1}, "num_hidden_layers"),  # fewer than the files hold
    ({"hidden_size": 64, "head_dim": 16}, "hidden_size"),
])
def test_config_json_is_checked_against_the_headers_first(tmp_path, no_big_allocation, edit, key):
    src, _ = _hf_dir(tmp_path, **edit)
    with pytest.raises(NdtrainError) as info:
        import_hf(src, tmp_path / "out")
    msg = str(info.value)
    assert key in msg and "\n" not in msg, msg
    assert not (tmp_path / "out").exists()


def test_a_model_larger_than_the_hosts_memory_is_refused(tmp_path, monkeypatch):
    src, _ = _hf_dir(tmp_path)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 100_000)  # 0.1 MB free
    with pytest.raises(NdtrainError, match=r"needs about [\d.,]+ MB of memory .*vocab_size.* 0\.1 MB available"):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_import_reads_every_tensor_exactly(tmp_path):
    from ndtrain.train.checkpoint import load_model_weights

    src, tensors = _hf_dir(tmp_path)
    ckpt = import_hf(src, tmp_path / "out")
    weights, _ = load_model_weights(ckpt)
    assert {to_hf_name(k) for k in weights} == set(tensors)
    assert all(torch.equal(weights[k], tensors[to_hf_name(k)]) for k in weights)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_follow_the_umask(tmp_path, umask):
    src, _ = _hf_dir(tmp_path)
    old = os.umask(umask)
    try:
        ckpt = import_hf(src, tmp_path / "ckpts")  # the checkpoint's files too (DCP, manifest, state)
        flat = export(ckpt, "safetensors", tmp_path / "flat.safetensors")
        hf = export(ckpt, "hf", tmp_path / "hf-out")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    files = [flat, hf / "model.safetensors", hf / "config.json", *(p for p in ckpt.rglob("*") if p.is_file())]
    assert len(files) > 4
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == want, (path, oct(path.stat().st_mode))
