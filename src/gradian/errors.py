"""Error types the CLI turns into one clear paragraph and an exit code (2: unusable input).

A `GradianError` may carry the id of the setup check it corresponds to (`check`, e.g. "model.not_causal_lm") and
the fix to show: the loaders raise it, `gradian diagnose` reports it under that id, and `attribute` stops with it,
so one loader serves every verb and no caller has to recognise an error by its text.
"""

from __future__ import annotations

from typing import Optional


class GradianError(Exception):
    """Base class: a problem the user can fix; the message says where and what to do."""

    exit_code = 2

    def __init__(self, message: str = "", *, check: Optional[str] = None, fix: Optional[str] = None):
        super().__init__(message)
        self.check = check
        self.fix = fix


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


class VerifyError(GradianError):
    """verify/fidelity cannot run on this run directory (no report, no recipe, nothing attributed)."""


class TrainingError(GradianError):
    """A training backend cannot run or failed (a missing extra, no GPU for unsloth, a train.command that failed,
    timed out or wrote no adapter); the message names the backend, the setting and the log."""


class ResourceError(GradianError):
    """Memory ran out (a CPU `MemoryError`, CUDA out of memory) in a stage; the message names the stage and the
    setting to lower. Nothing half written is left: every output is written atomically, after its stage."""
