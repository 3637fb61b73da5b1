"""`evaluation.metric` resolved into its `Metric` object: what every scorer uses."""

from __future__ import annotations

from pathlib import Path

from ...config import MetricKind, metric_kind
from .base import Metric, make_metric, metric_class
from .loader import import_metric


def metric_from_config(cfg) -> Metric:
    """`evaluation.metric` resolved; a Python metric is imported here (ConfigError naming the key when it cannot
    be), from the config file's directory first, then the environment."""
    e = cfg.evaluation
    if metric_kind(e.metric) is not MetricKind.python:
        return make_metric(e.metric, e.pattern, e.negate)
    _, module, func = e.metric.split(":")
    root = Path(cfg.root) if cfg.root else None
    return make_metric(e.metric, fn=import_metric(module, func, root, e.metric))


def as_metric(metric) -> Metric:
    """A `Metric` from a Metric or the name of a metric that needs no settings (exact_match, contains, loglik); a
    regex or Python metric needs its settings: `metric_from_config`."""
    if isinstance(metric, Metric):
        return metric
    try:
        needs = metric_class(str(metric)).needs_settings
    except ValueError:
        needs = True
    if needs:
        raise ValueError(f"metric {metric!r} needs its settings (evaluation.pattern, the imported function): pass "
                         "metric_from_config(cfg), not its name")
    return make_metric(str(metric))
