"""The verdict banner at the top of the HTML page: title, tone, the report's verdict text and the details that
explain it (the capability change and its interval, the accused rows and their rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..verdict import Verdict
from .plots import fmt_num
from .schema import Capability, Report
from .values import finite, signed


@dataclass(frozen=True)
class AccusedCount:
    """How many rows the page calls accused, and by which rule."""

    count: int
    rule: str
    capped: bool


@dataclass(frozen=True)
class RankingCaption:
    """What the ranking's rows are, in words: the terminal table's title and the HTML page's lead sentence. A smoke
    test's rows are its largest gradients, not rows that pushed toward anything: saying so is the only true
    sentence there."""

    title: str
    lead: str


def ranking_caption(report: Report) -> RankingCaption:
    if report.verdict is Verdict.smoke_test:
        return RankingCaption(
            "training rows with the largest gradients (a smoke test: outliers, not causes)",
            "Ranked by each row's squared gradient norm over the LoRA parameters, the largest gradients first: "
            "without an eval set there is nothing to attribute, so these are the rows most unlike the rest, not "
            "causes.")
    fixed = report.query.direction == "improvement"
    toward = "toward the answers the fine-tune fixed" if fixed else "toward the failure"
    return RankingCaption(
        f"training rows that pushed the model {toward}",
        f"Ranked by attribution score: how strongly each row's gradient pushed the model {toward} on the "
        f"{'fixed' if fixed else 'failing'} items.")


def accused(report: Report) -> AccusedCount:
    """The accused count and rule; a report written before the accused rule accuses its whole ranking."""
    acc = report.accused
    if acc is not None:
        return AccusedCount(acc.count, acc.rule, acc.capped_at_top_k)
    return AccusedCount(len(report.ranking) if report.verdict is Verdict.attributed else 0, "", False)


@dataclass(frozen=True)
class Change:
    """The capability figures the banner quotes, from the report's `capability` (a non-finite figure is absent)."""

    metric: str
    conf_txt: str
    lo: Optional[float]
    hi: Optional[float]
    base: Optional[float]
    tuned: Optional[float]
    delta: Optional[float]
    n: Optional[int]
    mdd: Optional[float]

    @classmethod
    def of(cls, cap: Optional[Capability]) -> "Change":
        if cap is None:
            return cls("the metric", "confidence", None, None, None, None, None, None, None)
        conf = finite(cap.confidence)
        base, tuned, delta = finite(cap.base), finite(cap.tuned), finite(cap.delta)
        if delta is None and base is not None and tuned is not None:
            delta = tuned - base
        return cls(metric=cap.metric or "the metric",
                   conf_txt=f"{conf * 100:.0f}%" if conf is not None else "confidence",
                   lo=finite(cap.ci[0]), hi=finite(cap.ci[1]), base=base, tuned=tuned, delta=delta, n=cap.n,
                   mdd=finite(cap.min_detectable_delta))

    def sentence(self) -> str:
        """"<metric> went from <base> (base) to <tuned> (fine-tuned), ..." or "" without both figures."""
        if self.base is None or self.tuned is None:
            return ""
        s = f"{self.metric} went from {fmt_num(self.base, 3)} (base) to {fmt_num(self.tuned, 3)} (fine-tuned)"
        if self.delta is not None:
            s += f", a change of {signed(self.delta)}"
        if self.lo is not None and self.hi is not None:
            s += f" ({self.conf_txt} interval {fmt_num(self.lo, 3)} to {fmt_num(self.hi, 3)})"
        if self.n is not None:
            s += f" over {self.n} eval items"
        return s + "."


def _attributed(ch: Change, report: Report) -> tuple[str, str, str, list[str]]:
    details = [ch.sentence()] if ch.sentence() else []
    acc = accused(report)
    n_acc, n_listed = acc.count, len(report.ranking)
    if n_acc and acc.rule:
        details.append(f"{n_acc} training row{'' if n_acc == 1 else 's'} stand{'s' if n_acc == 1 else ''} out and "
                       f"{'is' if n_acc == 1 else 'are'} accused. {acc.rule}")
    elif n_acc:
        details.append(f"The {n_acc} highest-scoring training rows are listed as the accused below.")
    else:
        details.append("No training row stands out from the others' scores, so none is accused; the "
                       f"{n_listed} highest-scoring rows are listed for inspection.")
    return ("Attributed", "attributed",
            "The capability changed and the training rows that pushed it are ranked below.", details)


def _declined(ch: Change, report: Report) -> tuple[str, str, str, list[str]]:
    details = [ch.sentence()] if ch.sentence() else []
    lo, hi = ch.lo, ch.hi
    if lo is not None and hi is not None:
        details.append(
            f"The {ch.conf_txt} interval for the change, [{fmt_num(lo, 3)}, {fmt_num(hi, 3)}], "
            + ("includes zero." if lo <= 0 <= hi else "does not clear the significance test.")
        )
    if ch.mdd is not None:
        details.append(
            f"The smallest change this eval set can reliably detect is about {fmt_num(ch.mdd, 3)}; "
            "a larger eval set detects smaller changes."
        )
    return ("Declined: no attribution", "declined",
            "The capability did not change measurably, so there is nothing to attribute; no training rows are "
            "accused.", details)


def _smoke_test(ch: Change, report: Report) -> tuple[str, str, str, list[str]]:
    details = [ch.sentence()] if ch.sentence() else []
    details.append("Treat the ranking as a check that attribution runs, not as a finding.")
    return ("Smoke test: not evidence", "smoke",
            "This run exercised the pipeline end to end; the ranking below is not evidence about which rows caused "
            "a change.", details)


_BY_VERDICT: dict[Verdict, Callable[[Change, Report], tuple[str, str, str, list[str]]]] = {
    Verdict.attributed: _attributed, Verdict.declined: _declined, Verdict.smoke_test: _smoke_test}


def banner(report: Report) -> dict[str, Any]:
    """The banner of the report's verdict."""
    title, tone, default, details = _BY_VERDICT[report.verdict](Change.of(report.capability), report)
    return {
        "verdict": report.verdict,
        "declined": report.verdict is Verdict.declined,
        "title": title,
        "tone": tone,
        "text": report.verdict_text.strip() or default,
        "details": details,
    }
