"""`ndtrain prepare`: data/prepare.py's command, with the note on what the shipped configs make of
the validation split it wrote (train/preflight.py knows the configs; data/ sits below them)."""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[3] / "configs"  # in a clone; absent in an installed wheel


def main(argv: list[str]) -> int:
    from ndtrain.data.prepare import main as prepare_main
    from ndtrain.train.preflight import small_split_note

    return prepare_main(argv, note=lambda manifest: small_split_note(manifest, CONFIGS))
