"""docs/architecture.md names files and the functions in them ("`train/build.py`: `build`"); the
tree moves under it, so every such pair must still be true: the file exists under src/ndtrain
and defines the function or class. These tests read the page and the source text, nothing else."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "ndtrain"
# `path.py`: `name`, or [path.py](link): `name` (the name may be Class.method or end in "(...)").
PAIR = re.compile(r"(?:`([\w/]+\.py)`|\[([\w/\\]+\.py)\]\([^)]*\)):\s*`([\w.]+)")


def pairs(text: str) -> list[tuple[str, str]]:
    return [((a or b).replace("\\", ""), name) for a, b, name in PAIR.findall(" ".join(text.split()))]


def missing(found: list[tuple[str, str]], src: Path = SRC) -> list[str]:
    out = []
    for rel, name in found:
        path = src / rel
        if not path.is_file():
            out.append(f"{rel} (no such file)")
            continue
        last = name.split(".")[-1]
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(last)}\b", path.read_text(), re.MULTILINE):
            out.append(f"{rel}: {name} (not defined there)")
    return out


def test_every_file_and_function_the_architecture_page_names_exists():
    found = pairs((ROOT / "docs" / "architecture.md").read_text())
    assert len(found) > 15, f"only {len(found)} file: function pairs found: the pattern stopped seeing them"
    assert not missing(found), "docs/architecture.md names what is not there:\n" + "\n".join(missing(found))


def test_the_check_sees_a_gone_file_and_a_gone_function(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "job.py").write_text("def run():\n    pass\n\n\nclass Loop:\n    def step(self):\n        pass\n")
    text = ("[train/job.py](x): `run`, `train/job.py`: `Loop.step`, `train/job.py`:\n`_loop`, "
            "[config/\\_\\_init\\_\\_.py](y): `load_config`")
    assert pairs(text) == [("train/job.py", "run"), ("train/job.py", "Loop.step"), ("train/job.py", "_loop"),
                           ("config/__init__.py", "load_config")]
    assert missing(pairs(text), tmp_path) == ["train/job.py: _loop (not defined there)",
                                              "config/__init__.py (no such file)"]
