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


# What a strict pydantic check expected, by its error type, in the words of the one-line errors
# above ("{name}" reads the error's context); pydantic_problem applies it.
PYDANTIC_EXPECTED = {
    "bool_type": "true or false", "int_type": "an integer", "float_type": "a number", "string_type": "a string",
    "list_type": "a list", "dict_type": "an object", "model_type": "an object", "finite_number": "a finite number",
    "greater_than_equal": "at least {ge}", "greater_than": "greater than {gt}", "less_than_equal": "at most {le}",
    "less_than": "less than {lt}", "literal_error": "{expected}", "string_pattern_mismatch": "a string matching {pattern}",
    "too_long": "a list of at most {max_length} items",
}


def pydantic_problem(exc) -> tuple[str, str | None, object]:
    """The first error of a pydantic ValidationError, for one line: (the field's path, such as
    `shards[2].sha256`; what it expected, None where the field is missing; the value given)."""
    err = exc.errors(include_url=False)[0]
    path = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in err["loc"]).removeprefix(".")
    ctx = err.get("ctx", {})
    if err["type"] == "missing":
        return path, None, None
    if err["type"] == "too_short":
        what = "a non-empty list" if ctx["min_length"] == 1 else f"a list of at least {ctx['min_length']} items"
    else:
        what = PYDANTIC_EXPECTED[err["type"]].format(**ctx) if err["type"] in PYDANTIC_EXPECTED else err["msg"]
    return path, what, err["input"]
