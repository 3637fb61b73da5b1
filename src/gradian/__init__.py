"""Gradian: which training examples did this to my LoRA fine-tune?

The public API is `gradian.api` (`attribute`, `diagnose`, `evaluate`, `build_index`, `train`, `verify`, `fidelity`,
`load_config`); its functions are also reachable here (`gradian.attribute(...)`), imported on first use so that
`import gradian` stays light.
"""

from .version import __version__  # noqa: F401

_API = ("attribute", "build_index", "config_from_dict", "diagnose", "evaluate", "fidelity", "load_config", "train",
        "verify", "Config")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'gradian' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
