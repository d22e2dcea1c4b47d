"""A Hugging Face export says the end-of-document id `ndtrain generate` stops at: the byte
tokenizer's 255 (it was null), and null only for imported weights, which record no tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ndtrain.data.tokenizer import ByteTokenizer
from ndtrain.tools.interop import export, import_hf

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_dc37512" / "checkpoints" / "step_00000002"


@pytest.mark.timeout(120)
def test_byte_export_names_the_eos_generate_stops_at(tmp_path):
    ckpt = tmp_path / "checkpoints" / FIXTURE.name  # a byte-tokenizer run's checkpoint
    shutil.copytree(FIXTURE, ckpt)
    config = json.loads((export(ckpt, "hf", tmp_path / "hf") / "config.json").read_text())
    assert config["eos_token_id"] == ByteTokenizer.eos_id == 255

    # Imported weights carry no record of their data: no id is claimed (null, not HF's default 2).
    imported = import_hf(tmp_path / "hf", tmp_path / "imported" / "checkpoints")
    again = json.loads((export(imported, "hf", tmp_path / "hf2") / "config.json").read_text())
    assert "eos_token_id" in again and again["eos_token_id"] is None
