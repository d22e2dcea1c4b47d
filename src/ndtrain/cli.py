"""The `ndtrain` command.

Each subcommand lives in the package that owns it and exposes `main(argv) -> int`; this file only
dispatches, importing lazily so that `ndtrain plan` never imports torch.distributed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("ndtrain.train.command", "main", "train a model (single process, --nproc N, or under torchrun)"),
    "prepare": ("ndtrain.tools.prepare_command", "main", "tokenize text files into a binary token shard"),
    "generate": ("ndtrain.tools.generate_command", "main", "sample text from a checkpoint"),
    "config": ("ndtrain.tools.config_check", "config_main", "`config show`: the resolved config; `config check --world N`: check it for N ranks"),
    "verify": ("ndtrain.tools.verify", "main", "check that parallel layouts match a single process"),
    "plan": ("ndtrain.planner.command", "plan_main", "predict memory/time/MFU of layouts and pick the best"),
    "goodput": ("ndtrain.tools.goodput_costs", "main", "expected goodput and optimal checkpoint interval"),
    "calibrate": ("ndtrain.tools.calibrate_command", "main", "measure this machine (its GPUs, or its CPU ranks) for the planner"),
    "pipeline-report": ("ndtrain.tools.pipeline_report", "main", "draw a pipeline schedule timeline"),
    "export": ("ndtrain.tools.interop", "export_main", "export a checkpoint (safetensors or Hugging Face)"),
    "import": ("ndtrain.tools.interop", "import_main", "import Hugging Face Llama weights"),
    "report": ("ndtrain.tools.report", "main", "draw runs (loss, throughput, memory, restarts...) into one HTML file"),
    "dryrun": ("ndtrain.tools.dryrun", "main", "build one rank of an N-rank job and train one step on fake tensors: memory, FLOPs, traffic vs the planner"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: ndtrain <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ndtrain: error: unknown command {name!r} (commands: {', '.join(COMMANDS)}; "
              f"`ndtrain --help` describes them)", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("ndtrain"):
            print(f"ndtrain: command {name!r} is not available in this build ({exc.name} missing)", file=sys.stderr)
            return 2
        raise
    from ndtrain.errors import NdtrainError

    try:
        with _one_line_usage_errors():
            return int(getattr(module, func_name)(rest) or 0)
    except NdtrainError as exc:
        # An error every rank agreed on is printed once, by rank 0 (a group formed: RANK is checked).
        from ndtrain.launch_env import rank

        if not exc.all_ranks or rank() == 0:
            print(f"ndtrain {name}: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a path the checks up front could not foresee (a disk filling up, a race)
        if os.environ.get("NDTRAIN_DEBUG"):
            raise
        where = f": {exc.filename}" if exc.filename else ""
        print(f"ndtrain {name}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C where the command has no handling of its own (train's: train/signals.py)
        from ndtrain.train.signals import EXIT_INTERRUPTED

        print(f"ndtrain {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split("\n")).strip()


@contextlib.contextmanager
def _one_line_usage_errors():
    """argparse prints the usage and then the error (two or more lines) and exits; every ndtrain
    command instead reports a bad command line as one UsageError line, exit code 2. The
    dispatcher owns how errors look, so this covers every subcommand's parser (and its
    subparsers) without each one subclassing ArgumentParser."""
    from ndtrain.errors import UsageError

    def error(self, message):
        raise UsageError(message)

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original

if __name__ == "__main__":
    sys.exit(main())
