"""Checks of the eval set and the metric: is there a capability to measure, and can it be detected."""

from __future__ import annotations

from ..config import MetricKind
from .registry import Outcome, check, failed, passed, skipped

# evaluation.small_eval_set fails when the eval set cannot detect a delta smaller than this.
SMALL_EVAL_MDD = 0.2


@check("evaluation.no_eval_set", "warning",
       meaning="data.eval is not set: there is no capability to measure, and attribution is a smoke test.",
       fix="add data.eval: eval records ({prompt, answer}) of the capability that moved")
def _no_eval(ctx) -> Outcome:
    if not ctx.cfg.data.eval:
        return failed("data.eval is not set: `gradian evaluate` has nothing to measure and `gradian attribute` "
                      "would be a smoke test")
    return passed(f"data.eval '{ctx.cfg.data.eval}'")


@check("attribution.no_capability_target", "warning",
       meaning="Without an eval set the attribution has no capability target: its ranking shows the rows with the "
               "largest gradients (outliers), not causes.",
       fix="add data.eval with the items whose answers the fine-tune changed")
def _no_target(ctx) -> Outcome:
    if not ctx.cfg.data.eval:
        return failed("no data.eval: the ranking `gradian attribute` writes would be a smoke test (largest gradients)")
    return passed("data.eval gives the attribution a capability target")


@check("evaluation.small_eval_set", "warning",
       meaning=f"The eval set is too small to detect a moderate capability change: the minimum detectable delta "
               f"(paired test, 80% power, at evaluation.confidence) is above {SMALL_EVAL_MDD}.",
       fix="add eval items: the detectable delta shrinks with 1/sqrt(n) (about 200 items detect a 0.1 change)")
def _small_eval(ctx) -> Outcome:
    from ..capability.metrics import min_detectable_delta

    items = ctx.eval_items
    if items is None:
        return skipped("no eval set; see evaluation.no_eval_set")
    conf = ctx.cfg.evaluation.confidence
    mdd = min_detectable_delta(len(items), conf)
    msg = (f"{len(items)} eval items ({ctx.eval_path.name}) detect a delta of about {mdd:.2f} or more at "
           f"{int(round(conf * 100))}% confidence and 80% power")
    if mdd > SMALL_EVAL_MDD:
        return failed(msg + "; smaller changes will be declined as not significant")
    return passed(msg)


@check("evaluation.metric", "error",
       meaning="evaluation.metric cannot score the eval items: a Python metric (python:module:function) that does not "
               "import or has no such function, or (metric: regex without evaluation.pattern) an item whose answer "
               "is not a valid regular expression.",
       fix="put the metric's module beside the config file (or on PYTHONPATH) and define function(prompt, generated, "
           "item) -> float in [0, 1]; fix the pattern named in the message")
def _metric(ctx) -> Outcome:
    from ..capability.metrics import metric_from_config
    from ..errors import GradianError

    try:
        m = metric_from_config(ctx.cfg)
    except GradianError as e:
        return failed(str(e))
    items = ctx.eval_items
    if items:
        try:
            m.check_items(items)
        except GradianError as e:
            return failed(str(e))
    what = {"regex": f"regex {'not ' if m.negate else ''}matching "
                     f"{repr(m.pattern) if m.pattern is not None else 'each item' + chr(39) + 's answer'}"}
    return passed(f"evaluation.metric '{m.name}'" + (f" ({what[m.name]})" if m.name in what else ""))


@check("evaluation.metric_loglik", "info",
       meaning="evaluation.metric is loglik: the reference answer's log-likelihood moves with almost any fine-tune "
               "even when the generated answer does not change, and it gives no generated wrong answer to contrast "
               "with (queries fall back to classic).",
       fix="for factual or format capabilities use evaluation.metric: exact_match (or contains), which measure what "
           "the model actually says")
def _metric_loglik(ctx) -> Outcome:
    m = ctx.cfg.evaluation.metric
    if ctx.cfg.evaluation.metric_kind is MetricKind.loglik:
        return failed("evaluation.metric is 'loglik': a shift in likelihood is not a changed answer, and the "
                      "contrastive query falls back to classic")
    return passed(f"evaluation.metric '{m}'")
