"""Process-wide settings that make runs reproducible and fast on shared CPUs: seeds, threads, determinism.

Light to import: torch, numpy and transformers are imported inside the functions that use them, so that
`gradian --help` (whose verbs import this module) does not pay for them.
"""

from __future__ import annotations

import os
import random
from typing import Optional

_configured = False


def configure_threads(threads: Optional[int] = None) -> int:
    """One intra-op thread on CPU unless the user asks otherwise.

    On two shared cores OpenMP spin-waits made the same step 10-60x slower, so a single thread is the default.
    `GRADIAN_THREADS` or `model.threads` overrides it.
    """
    import torch

    global _configured
    env = os.environ.get("GRADIAN_THREADS")
    if threads is None and env:
        try:
            threads = int(env)
            assert threads >= 1
        except (ValueError, AssertionError):
            from .errors import ConfigError

            raise ConfigError(f"GRADIAN_THREADS={env!r}: expected a positive integer", check="runtime.threads") from None
    n = threads or 1
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if not _configured:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # already set once the interop pool started; harmless
        _configured = True
    return n


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def quiet_libraries() -> None:
    """Gradian draws its own progress; the libraries' loading bars and deprecation chatter are noise to a user.

    This imports transformers (about a second), so the CLI calls it at the start of the verbs that load models,
    never at startup: `gradian --help` and `gradian report` do not need it. Calling it twice is harmless.
    """
    import warnings

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")
    warnings.filterwarnings("ignore", message=r".*save_embedding_layers.*")
