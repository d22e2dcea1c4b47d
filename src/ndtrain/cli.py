"""The `ndtrain` command.

Each subcommand lives in the package that owns it and exposes `main(argv) -> int`; this file only
dispatches, importing lazily so that `ndtrain plan` never imports torch.distributed.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("ndtrain.tools.auto", "train_main", "train a model (single process, --nproc N, or under torchrun)"),
    "prepare": ("ndtrain.data.prepare", "main", "tokenize text files into a binary token shard"),
    "generate": ("ndtrain.train.generate", "main", "sample text from a checkpoint"),
    "config": ("ndtrain.tools.config_check", "config_main", "`config show`: the resolved config; `config check --world N`: check it for N ranks"),
    "verify": ("ndtrain.tools.verify", "main", "check that parallel layouts match a single process"),
    "plan": ("ndtrain.planner.command", "plan_main", "predict memory/time/MFU of layouts and pick the best"),
    "goodput": ("ndtrain.planner.command", "goodput_main", "expected goodput and optimal checkpoint interval"),
    "calibrate": ("ndtrain.tools.calibrate", "main", "measure this machine's FLOP/s and collective bandwidth"),
    "pipeline-report": ("ndtrain.tools.pipeline_report", "main", "draw a pipeline schedule timeline"),
    "export": ("ndtrain.train.interop", "export_main", "export a checkpoint (safetensors or Hugging Face)"),
    "import": ("ndtrain.train.interop", "import_main", "import Hugging Face Llama weights"),
    "report": ("ndtrain.tools.report", "main", "draw runs (loss, throughput, memory, restarts...) into one HTML file"),
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
        print(f"ndtrain: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
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
        return int(getattr(module, func_name)(rest) or 0)
    except NdtrainError as exc:
        print(f"ndtrain {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
