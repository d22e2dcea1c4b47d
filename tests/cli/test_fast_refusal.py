"""A typo is answered before the heavy imports: `ndtrain train` checks its config before torch is
imported, and nothing a dense model's `generate` or `export` runs imports torch._dynamo (only a
MoE layer, built, needs it). Counted in modules imported, never in seconds: each check runs in a
fresh interpreter that prints what sys.modules held when the command returned."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def _fresh(code: str, hang_deadline) -> dict:
    """Run `code` in a fresh interpreter; it leaves its findings in the dict `found`."""
    script = "import json, sys\nfound = {}\n" + textwrap.dedent(code) + "\nprint('FOUND' + json.dumps(found))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=hang_deadline(600))
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("FOUND"))
    return {**json.loads(line[5:]), "stderr": proc.stderr}


@pytest.mark.parametrize("argv, key", [
    (["train", "--train.stepz=3"], r"train.stepz"),
    (["train", "--optimizer.lr=nan", "--nproc", "2"], r"optimizer.lr"),
    (["train", "--optimizer.extend=rewind"], r"optimizer.extend"),
])
def test_train_refuses_a_bad_config_before_importing_torch(argv, key, hang_deadline):
    found = _fresh(f"""
        from ndtrain.cli import main
        found["rc"] = main({argv!r})
        found["torch"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    """, hang_deadline)
    lines = [line for line in found["stderr"].splitlines() if line.strip()]
    assert found["rc"] == 2 and len(lines) == 1 and key in lines[0], found
    assert found["torch"] == [], found["torch"][:5]


def test_a_utf16_config_is_read_and_its_typo_refused_before_torch(tmp_path, hang_deadline):
    (tmp_path / "u16.toml").write_bytes("[train]\nsteps = 3\n".encode("utf-16"))  # what PowerShell's `>` writes
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf[train]\nsteps = 4\n")
    (tmp_path / "typo.toml").write_bytes("[train]\nstepz = 3\n".encode("utf-16"))
    found = _fresh(f"""
        from ndtrain.config import load_config
        from ndtrain.cli import main
        found["steps"] = [load_config({str(tmp_path / 'u16.toml')!r}).train.steps,
                          load_config({str(tmp_path / 'bom.toml')!r}).train.steps]
        found["rc"] = main(["train", "--config", {str(tmp_path / 'typo.toml')!r}])
        found["torch"] = "torch" in sys.modules
    """, hang_deadline)
    assert found["steps"] == [3, 4]
    assert found["rc"] == 2 and "train.stepz" in found["stderr"] and not found["torch"], found


def test_config_show_help_prints_usage_and_exits_0(hang_deadline):
    proc = subprocess.run([sys.executable, "-m", "ndtrain", "config", "show", "--help"], capture_output=True,
                          text=True, timeout=hang_deadline(600))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ndtrain config show") and proc.stderr == ""


def test_dense_model_and_checkpoint_reading_do_not_import_dynamo(hang_deadline):
    """What generate and export build (a dense model on the meta device) leaves torch._dynamo
    out; a MoE layer built takes it in, with its eager methods wrapped once."""
    found = _fresh("""
        from ndtrain.model.config import PRESETS, ModelConfig
        from ndtrain.model.llama import build_model
        from ndtrain.model import moe
        build_model(ModelConfig(preset="debug", **PRESETS["debug"]), "meta")
        found["dense"] = "torch._dynamo" in sys.modules
        for _ in range(2):
            build_model(ModelConfig(preset="debug-moe", **PRESETS["debug-moe"]), "meta")
        found["moe"] = "torch._dynamo" in sys.modules
        found["eager"] = [getattr(getattr(moe.MoE, n), "_torchdynamo_disable", False) for n in moe._EAGER_METHODS]
        found["wrapped_once"] = all(not hasattr(getattr(moe.MoE, n).__wrapped__, "_torchdynamo_disable")
                                    for n in moe._EAGER_METHODS)
    """, hang_deadline)
    assert found["dense"] is False and found["moe"] is True
    assert found["eager"] == [True, True] and found["wrapped_once"], found


def _refused_before_torch(argv: list[str], hang_deadline) -> dict:
    """Run the command `argv` in a fresh interpreter; its exit code, its stderr lines and whether
    torch was imported when it returned."""
    found = _fresh(f"""
        from ndtrain.cli import main
        found["rc"] = main({argv!r})
        found["torch"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    """, hang_deadline)
    found["lines"] = [line for line in found.pop("stderr").splitlines() if line.strip()]
    return found


@pytest.mark.parametrize("argv, rc, key", [
    (["generate", "--checkpoint", "{tmp}/gone"], 2, "gone: no such checkpoint"),
    (["generate", "--checkpoint", "{tmp}/gone", "--tokenz", "5"], 2, "--tokenz"),
    (["generate", "--checkpoint", "{tmp}/gone", "--temperature", "-1"], 2, "--temperature"),
    (["generate", "--checkpoint", "{tmp}", "--top-k", "-3"], 2, "--top-k"),
    (["export", "--checkpoint", "{tmp}/gone", "--to", "hf", "{tmp}/out"], 2, "gone: no such checkpoint"),
    (["export", "--checkpoint", "{tmp}", "--to", "onnx", "{tmp}/out"], 2, "--to"),
    (["export", "--checkpoint", "{tmp}", "--to", "safetensors", "{tmp}/mine.safetensors"], 2,
     "mine.safetensors already exists"),
], ids=["generate-missing", "generate-bad-flag", "generate-bad-temperature", "generate-bad-top-k",
        "export-missing", "export-bad-format", "export-out-exists"])
def test_generate_and_export_refuse_bad_arguments_before_importing_torch(tmp_path, argv, rc, key, hang_deadline):
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"the user's own file")
    found = _refused_before_torch([a.replace("{tmp}", str(tmp_path)) for a in argv], hang_deadline)
    assert found["rc"] == rc and len(found["lines"]) == 1 and key in found["lines"][0], found
    assert found["torch"] == [], found["torch"][:5]
    assert mine.read_bytes() == b"the user's own file" and sorted(p.name for p in tmp_path.iterdir()) == [mine.name]


def test_generate_past_its_checks_does_import_torch(tmp_path, hang_deadline):
    """The other side of the refusals above: a checkpoint path that exists takes generate on to
    the checkpoint package (and torch), which says what is wrong with it."""
    found = _refused_before_torch(["generate", "--checkpoint", str(tmp_path)], hang_deadline)
    assert found["rc"] == 2 and "no checkpoint found" in found["lines"][0] and "torch" in found["torch"], found
