"""The per-item metric and the paired bootstrap: pure functions over answers and scores.

`evaluation.metric` names what "the capability" is, item by item, as a score in [0, 1]:

* ``exact_match``: the answer equals the reference after stripping white space and one trailing period;
* ``contains``: the reference is a case-insensitive substring of the answer;
* ``loglik``: the reference answer's per-token probability (no generation needed to score);
* ``regex``: `re.search` of a pattern in the answer, the item's ``answer`` or ``evaluation.pattern`` for every item;
  ``evaluation.negate: true`` passes the items where it does not match ("must not refuse");
* ``python:module:function``: ``function(prompt, generated, item) -> float in [0, 1]``, `item` the eval record as a
  dict; the module is imported from the config file's directory, else from the environment (never from the data).

`Metric` is the resolved form every scorer uses (`metric_from_config`); its errors name the key and what to do.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import ConfigError, DataError



def normalize_answer(s: str) -> str:
    """exact_match normalisation: surrounding white space and one trailing period."""
    s = s.strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    return s


def exact_match(generated: str, expected: str) -> float:
    return float(normalize_answer(generated) == normalize_answer(expected))


def contains(generated: str, expected: str) -> float:
    return float(expected.strip().lower() in generated.lower())


METRICS = {"exact_match": exact_match, "contains": contains}


def item_score(metric: str, generated: str, expected: str) -> float:
    """One eval item's score under `metric` (exact_match or contains; loglik items are scored from log-probabilities,
    see `loglik_score`)."""
    return float(METRICS[metric](generated, expected))


@dataclass(frozen=True)
class Metric:
    """A resolved `evaluation.metric`: `score(item, generated)` in [0, 1] for every metric that scores generated
    answers (`generative`); loglik scores the reference's probability instead (`loglik_score`)."""

    name: str
    pattern: Optional[str] = None
    negate: bool = False
    fn: Optional[Callable[..., Any]] = field(default=None, compare=False)

    @property
    def generative(self) -> bool:
        return self.name != "loglik"

    @property
    def needs_answer(self) -> bool:
        """Whether eval records need a reference `answer` (not for a fixed regex or a Python metric)."""
        return not (self.name.startswith("python:") or (self.name == "regex" and self.pattern is not None))

    def check_items(self, items) -> None:
        """Every item's answer compiles as a pattern (regex without evaluation.pattern): DataError naming it."""
        if self.name != "regex" or self.pattern is not None:
            return
        for it in items:
            try:
                re.compile(it.answer)
            except re.error as e:
                raise DataError(f"{it.source or it.id}: 'answer' is not a valid regular expression ({e}): "
                                f"{it.answer!r}; with evaluation.metric: regex each item's answer is the pattern "
                                "searched in the generated answer (or set evaluation.pattern for every item)",
                                check="data.invalid_record") from None

    def score(self, item, generated: str) -> float:
        if self.name in METRICS:
            return item_score(self.name, generated, item.answer)
        if self.name == "regex":
            hit = re.search(self.pattern if self.pattern is not None else item.answer, generated) is not None
            return float(hit != self.negate)
        if self.fn is not None:
            return self._call(item, generated)
        raise ValueError(f"metric {self.name!r} does not score generated answers")

    def _call(self, item, generated: str) -> float:
        where = item.source or item.id
        try:
            v = self.fn(item.question_text(), generated, dict(item.record or {}))
        except Exception as e:  # the user's function failed: say where, without our traceback
            raise ConfigError(f"evaluation.metric '{self.name}' raised {type(e).__name__} on {where}: "
                              f"{' '.join(str(e).split())[:300]}; fix the function (it is called as "
                              "score(prompt, generated, item) with item the eval record as a dict)") from None
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = float("nan")
        if not (0.0 <= f <= 1.0):
            raise ConfigError(f"evaluation.metric '{self.name}' returned {v!r} on {where}; it must return a number "
                              "in [0, 1] (1 = the item passes)")
        return f


def metric_from_config(cfg) -> Metric:
    """`evaluation.metric` resolved; a Python metric is imported here (ConfigError naming the key when it cannot
    be), from the config file's directory first, then the environment."""
    e = cfg.evaluation
    if not e.metric.startswith("python:"):
        return Metric(e.metric, e.pattern, e.negate)
    _, module, func = e.metric.split(":")
    root = Path(cfg.root) if cfg.root else None
    return Metric(e.metric, fn=import_metric(module, func, root, e.metric))


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
    import hashlib
    import importlib.util

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


def as_metric(metric) -> Metric:
    """A `Metric` from a Metric or the name of a metric that needs no settings (exact_match, contains, loglik); a
    regex or Python metric needs its settings: `metric_from_config`."""
    if isinstance(metric, Metric):
        return metric
    if str(metric) not in ("exact_match", "contains", "loglik"):
        raise ValueError(f"metric {metric!r} needs its settings (evaluation.pattern, the imported function): pass "
                         "metric_from_config(cfg), not its name")
    return Metric(str(metric))


def loglik_score(logprob: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
    """Per-token probability of the expected answer (the geometric mean): a fraction in [0, 1] like the others."""
    return np.exp(np.asarray(logprob) / np.maximum(np.asarray(n_tokens), 1))


def paired_bootstrap(
    base: Sequence[float], tuned: Sequence[float], *, samples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Delta (tuned - base) of the means and its paired percentile-bootstrap interval."""
    d = np.asarray(tuned, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    n = d.size
    if n == 0:
        return 0.0, 0.0, 0.0
    delta = float(d.mean())
    if np.all(d == d[0]):
        # Every resample has the same mean; the interval is that point, never NaN.
        return delta, delta, delta
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    step = max(1, 2_000_000 // n)  # resample in blocks so a large eval set does not allocate samples x n at once
    for s in range(0, samples, step):
        m = min(step, samples - s)
        idx = rng.integers(0, n, size=(m, n))
        means[s : s + m] = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return delta, float(lo), float(hi)


def min_detectable_delta(n: int, confidence: float = 0.95, power: float = 0.8, sd: float = 0.5) -> float:
    """Smallest |delta| a paired test on n items detects with this power, for per-item differences of spread sd.

    sd = 0.5 is the spread of a 50/50 binary outcome, the conservative case for exact_match and contains.
    """
    if n <= 0:
        return float("inf")
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2) + NormalDist().inv_cdf(power)
    return float(z * sd / np.sqrt(n))
