"""Importing a Python metric's function: from the config file's directory first (under a module name of its own, so
two configs' `metrics.py` never collide), else from the environment. The only code that edits `sys.path` and
`sys.modules`, and it undoes the `sys.path` edit."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable, Optional

from ...errors import ConfigError


def _local_file(module: str, root: Optional[Path]) -> Optional[Path]:
    """The module's file in the config's directory, if it is there."""
    if root is None:
        return None
    rel = Path(*module.split("."))
    for cand in (Path(root) / rel.with_suffix(".py"), Path(root) / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _load_file(path: Path):
    """Import a config directory's module from its file under a name of its own (path and modification time): two
    configs with a `metrics.py` each, or an edited one, never get a module another config imported first."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_mtime_ns}:{st.st_size}".encode()).hexdigest()[:16]
    name = f"_gradian_metric_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def import_metric(module: str, func: str, root: Optional[Path], name: str) -> Callable:
    """`module.func`, imported from `root` (the config's directory) or the environment; ConfigError naming the key
    `name` when the module does not import or has no such function."""
    where = f"the config's directory ({root}) or " if root else ""
    added = root is not None and str(root) not in sys.path
    if added:
        sys.path.insert(0, str(root))
    try:
        local = _local_file(module, root)
        mod = _load_file(local) if local is not None else importlib.import_module(module)
    except Exception as e:  # ModuleNotFoundError, or the module's own import-time error
        raise ConfigError(f"evaluation.metric '{name}': cannot import module '{module}' ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}); put {module.replace('.', '/')}.py in {where}a "
                          "directory on PYTHONPATH, and check that it imports") from None
    finally:
        if added:
            sys.path.remove(str(root))
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ConfigError(f"evaluation.metric '{name}': module '{module}' ({getattr(mod, '__file__', '?')}) has no "
                          f"function '{func}'; define {func}(prompt, generated, item) -> float in [0, 1]")
    return fn
