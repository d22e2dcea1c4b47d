"""User-facing errors: raised for bad input and printed by the CLI as one line, with exit code 2."""


class NdtrainError(Exception):
    """A problem with the user's input (config, data, checkpoint, world size). Never a bug."""


class ConfigError(NdtrainError):
    """An invalid configuration value; the message names the offending key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"config key '{key}': {message}")
        self.key = key
