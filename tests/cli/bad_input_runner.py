"""Runs bad-input cases through `ndtrain.cli.main` in this one process (not a test module).

    python tests/cli/bad_input_runner.py CASES.json RESULTS.json

Each case: {"id", "argv", "cwd", "roots", "env"}. For each, every file under `roots` is hashed before
and after, `env` (optional) is set in the environment for the case alone, and the process's file
descriptors 1 and 2 are redirected to files while the command
runs, so whatever reaches the terminal (Python prints, logging, warnings, C++ messages from
torch) is what the result records. Results: {"id": {"rc", "stdout", "stderr", "changed"}}.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path


def snapshot(roots: list[str]) -> dict[str, str]:
    out = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_case(argv: list[str], cwd: str) -> tuple[object, str, str]:
    from ndtrain.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        here = os.getcwd()
        try:
            os.chdir(cwd)
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = f"SystemExit({exc.code})"
            except BaseException as exc:  # a bug: recorded, and the test fails with it
                import traceback

                traceback.print_exc()
                rc = f"raised {type(exc).__name__}"
        finally:
            os.chdir(here)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for case in cases:
        before = snapshot(case["roots"])
        saved_env = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        try:
            rc, out, err = run_case(case["argv"], case["cwd"])
        finally:
            for k, v in saved_env.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        after = snapshot(case["roots"])
        changed = sorted(p for p, digest in before.items() if after.get(p) != digest)
        results[case["id"]] = {"rc": rc, "stdout": out[-4000:], "stderr": err[-4000:], "changed": changed}
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
