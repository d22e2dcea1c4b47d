"""A malformed command line is one line on stderr and exit code 2, whatever the command: the
dispatcher (cli.py) installs the one argparse error handler for every command's parser, so no
command repeats it in a parser class of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ndtrain
from ndtrain.cli import main


@pytest.mark.parametrize("argv, said", [
    (["plan", "--model", "llama3-8b", "--gpus", "64", "--top", "three"], "argument --top: invalid int value: 'three'"),
    (["goodput", "--gpus", "eight"], "argument --gpus: invalid int value: 'eight'"),
    (["verify", "--layouts", "dp_shard=2", "--steps", "two"], "argument --steps: invalid int value: 'two'"),
    (["prepare"], "the following arguments are required: --out"),
])
def test_a_malformed_command_line_is_one_line_exit_2(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ndtrain {argv[0]}: error: ") and said in err and err.count("\n") == 1, err


def test_no_command_defines_a_parser_class_of_its_own():
    src = Path(ndtrain.__file__).parent
    own = [f"{path.relative_to(src)}: {node.name}" for path in sorted(src.rglob("*.py"))
           for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
           and any("ArgumentParser" in ast.unparse(base) for base in node.bases)]
    assert own == []
