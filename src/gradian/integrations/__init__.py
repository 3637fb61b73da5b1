"""Integrations with other trainers: `GradianCallback` for a transformers `Trainer` or TRL `SFTTrainer` run.

Imported lazily, so `import gradian.integrations` costs nothing until the callback is used."""

from __future__ import annotations

__all__ = ["GradianCallback"]


def __getattr__(name: str):
    if name == "GradianCallback":
        from .callback import GradianCallback

        return GradianCallback
    raise AttributeError(name)
