"""The per-item metric (one class per `evaluation.metric` kind) and the paired bootstrap.

`evaluation.metric` names what "the capability" is, item by item, as a score in [0, 1]:

* ``exact_match``: the answer equals the reference after stripping white space and one trailing period;
* ``contains``: the reference is a case-insensitive substring of the answer;
* ``loglik``: the reference answer's per-token probability (no generation needed to score);
* ``regex``: `re.search` of a pattern in the answer, the item's ``answer`` or ``evaluation.pattern`` for every item;
  ``evaluation.negate: true`` passes the items where it does not match ("must not refuse");
* ``python:module:function``: ``function(prompt, generated, item) -> float in [0, 1]``, `item` the eval record as a
  dict; the module is imported from the config file's directory, else from the environment (never from the data).

Modules: `base` (the `Metric` interface and the registry of kinds; calling `Metric(name, ...)` builds the kind's
class), `answers` (exact_match, contains, regex), `loglik`, `python_metric` (a user's function), `loader` (importing
that function: the only place that touches `sys.path`/`sys.modules`), `resolve` (`metric_from_config`,
`as_metric`), `bootstrap` (the paired bootstrap and the detectable delta: pure statistics).
"""

from .answers import ContainsMetric, ExactMatchMetric, RegexMetric, contains, exact_match, normalize_answer
from .base import Metric, is_binary_metric, make_metric, metric_class
from .bootstrap import min_detectable_delta, paired_bootstrap
from .loader import import_metric
from .loglik import LoglikMetric, loglik_score
from .python_metric import PythonMetric
from .resolve import as_metric, metric_from_config

__all__ = ["ContainsMetric", "ExactMatchMetric", "LoglikMetric", "Metric", "PythonMetric", "RegexMetric", "as_metric",
           "contains", "exact_match", "import_metric", "is_binary_metric", "loglik_score", "make_metric",
           "metric_class", "metric_from_config", "min_detectable_delta", "normalize_answer", "paired_bootstrap"]
