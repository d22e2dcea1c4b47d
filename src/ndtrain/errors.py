"""User-facing errors: raised for bad input and printed by the CLI as one line, with exit code 2."""


class NdtrainError(Exception):
    """A problem with the user's input (config, data, checkpoint, world size). Never a bug.

    `all_ranks`: every rank of a process group raises the same error (it was agreed, e.g. by a
    broadcast), so only rank 0 prints it and the user sees one line, not one per rank."""

    exit_code = 2

    def __init__(self, message: str = "", all_ranks: bool = False):
        super().__init__(message)
        self.all_ranks = all_ranks


class ConfigError(NdtrainError):
    """An invalid configuration value; the message names the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config key '{key}': {message}")
        self.key = key


class UsageError(NdtrainError):
    """A malformed command line (what argparse reports), as one line instead of usage + error."""


class RunError(NdtrainError):
    """The run could not go on for a reason outside its input: a full disk, a dead peer rank.
    One line, like input errors, but exit code 1 (a launcher may retry it)."""

    exit_code = 1
