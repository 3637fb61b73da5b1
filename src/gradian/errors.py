"""Error types the CLI turns into one clear paragraph and an exit code (2: unusable input)."""


class GradianError(Exception):
    """Base class: a problem the user can fix; the message says where and what to do."""

    exit_code = 2


class ConfigError(GradianError):
    """The config file or a --set override is invalid; the message names the key path."""


class DataError(GradianError):
    """A data file is unreadable or a record is malformed; the message names file and line."""


class ModelError(GradianError):
    """The model or adapter cannot be attributed over (not a causal LM, not LoRA, ...)."""


class IndexError_(GradianError):
    """A gradient index on disk is corrupt, truncated or built for something else."""


class CheckFailed(GradianError):
    """`diagnose` found error-level problems; attribution does not start."""
