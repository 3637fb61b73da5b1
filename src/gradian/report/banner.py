"""The verdict banner at the top of the HTML page: title, tone, the report's verdict text and the details that
explain it (the capability change and its interval, the accused rows and their rule)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .plots import fmt_num
from .values import as_float, as_int, as_list, as_str, signed


def accused(report: Mapping[str, Any]) -> dict[str, Any]:
    """The accused count and rule; a report written before the accused rule accuses its whole ranking."""
    acc = report.get("accused")
    if isinstance(acc, Mapping) and as_int(acc.get("count")) is not None:
        return {"count": as_int(acc.get("count")), "rule": as_str(acc.get("rule")),
                "capped": bool(acc.get("capped_at_top_k"))}
    n = len(as_list(report.get("ranking"))) if as_str(report.get("verdict")) == "attributed" else 0
    return {"count": n, "rule": "", "capped": False}


@dataclass(frozen=True)
class Change:
    """The capability figures the banner quotes, coerced from the report's `capability`."""

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
    def of(cls, cap: Mapping[str, Any]) -> "Change":
        conf = as_float(cap.get("confidence"))
        ci = as_list(cap.get("ci"))
        base, tuned, delta = as_float(cap.get("base")), as_float(cap.get("tuned")), as_float(cap.get("delta"))
        if delta is None and base is not None and tuned is not None:
            delta = tuned - base
        return cls(metric=as_str(cap.get("metric")) or "the metric",
                   conf_txt=f"{conf * 100:.0f}%" if conf is not None else "confidence",
                   lo=as_float(ci[0]) if len(ci) > 0 else None, hi=as_float(ci[1]) if len(ci) > 1 else None,
                   base=base, tuned=tuned, delta=delta, n=as_int(cap.get("n")),
                   mdd=as_float(cap.get("min_detectable_delta")))

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


def _attributed(ch: Change, report: Mapping[str, Any]) -> tuple[str, str, str, list[str]]:
    details = [ch.sentence()] if ch.sentence() else []
    acc = accused(report)
    n_acc, n_listed = acc["count"], len(as_list(report.get("ranking")))
    if n_acc and acc["rule"]:
        details.append(f"{n_acc} training row{'' if n_acc == 1 else 's'} stand{'s' if n_acc == 1 else ''} out and "
                       f"{'is' if n_acc == 1 else 'are'} accused: {acc['rule']}.")
    elif n_acc:
        details.append(f"The {n_acc} highest-scoring training rows are listed as the accused below.")
    else:
        details.append("No training row stands out from the others' scores, so none is accused; the "
                       f"{n_listed} highest-scoring rows are listed for inspection.")
    return ("Attributed", "attributed",
            "The capability changed and the training rows that pushed it are ranked below.", details)


def _declined(ch: Change, report: Mapping[str, Any]) -> tuple[str, str, str, list[str]]:
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


def _smoke_test(ch: Change, report: Mapping[str, Any]) -> tuple[str, str, str, list[str]]:
    details = [ch.sentence()] if ch.sentence() else []
    details.append("Treat the ranking as a check that attribution runs, not as a finding.")
    return ("Smoke test: not evidence", "smoke",
            "This run exercised the pipeline end to end; the ranking below is not evidence about which rows caused "
            "a change.", details)


_BY_VERDICT = {"attributed": _attributed, "declined": _declined, "smoke_test": _smoke_test}


def banner(report: Mapping[str, Any], cap: Mapping[str, Any]) -> dict[str, Any]:
    """The banner of the report's verdict (an unknown verdict gets a neutral one naming it)."""
    verdict = as_str(report.get("verdict")).strip() or "unknown"
    build = _BY_VERDICT.get(verdict)
    if build is None:
        title, tone, default, details = (f"Verdict: {verdict}", "unknown",
                                         "This report has a verdict this version of gradian does not know.", [])
    else:
        title, tone, default, details = build(Change.of(cap), report)
    return {
        "verdict": verdict,
        "title": title,
        "tone": tone,
        "text": as_str(report.get("verdict_text")).strip() or default,
        "details": details,
    }
