"""The check registry: results, outcomes and the `@check(id, level, meaning=..., fix=...)` decorator.

Each check is a function of a `Context` (`checks.context`) that returns `passed(...)`, `failed(...)` or
`skipped(...)`. When a resource a check needs did not load, the context raises `Unavailable` naming the check that
owns that failure: that check fails with the loader's message, every other one that needed it is skipped. Checks run
in `ORDER` (the order `diagnose` prints and report flags follow), whatever module registered them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import GradianError

LEVELS = ("error", "warning", "info")
STATUSES = ("pass", "fail", "skip")

# The order `diagnose` prints the checks in (and report flags follow): configuration, runtime, data, tokenizer,
# model, adapter, evaluation, resources, and last the dry run of one row through the capture.
ORDER = (
    "config.paths", "device.unavailable", "device.mps_not_auto", "runtime.threads",
    "data.unreadable_record", "data.empty", "data.unknown_record_shape", "data.invalid_record", "data.duplicate_rows",
    "tokenizer.load_failed", "data.no_chat_template", "data.tokenize_failed", "data.no_supervised_tokens",
    "model.context_length", "model.load_failed", "model.not_causal_lm", "tokenizer.vocab_mismatch",
    "model.full_finetune", "adapter.unreadable", "adapter.not_lora", "adapter.task_type", "adapter.quantized",
    "adapter.base_mismatch", "adapter.skipped_modules", "train.target_modules", "train.not_converged",
    "evaluation.no_eval_set", "attribution.no_capability_target", "evaluation.small_eval_set",
    "evaluation.metric", "evaluation.metric_loglik", "memory.logit_upcast", "index.size", "capture.dry_run",
)


# ------------------------------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    id: str
    level: str  # error | warning | info
    status: str  # pass | fail | skip
    message: str
    fix: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "level": self.level, "status": self.status, "message": self.message, "fix": self.fix}


@dataclass
class Outcome:
    status: str
    message: str
    fix: Optional[str] = None
    level: Optional[str] = None


def passed(message: str) -> Outcome:
    return Outcome("pass", message)


def failed(message: str, fix: Optional[str] = None, level: Optional[str] = None) -> Outcome:
    """A failed check. `fix` defaults to the registered fix; `level` overrides the registered level."""
    return Outcome("fail", message, fix, level)


def skipped(reason: str) -> Outcome:
    return Outcome("skip", reason)


class Unavailable(Exception):
    """A resource did not load. `owner` is the check that reports why; the others skip."""

    def __init__(self, owner: str, message: str, fix: Optional[str] = None, what: str = "", level: Optional[str] = None):
        super().__init__(message)
        self.owner, self.message, self.fix, self.what, self.level = owner, message, fix, what, level


# ------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Check:
    id: str
    level: str
    meaning: str
    fix: str
    fn: Callable[[object], Outcome]


REGISTRY: dict[str, Check] = {}


def check(id: str, level: str, *, meaning: str, fix: str):
    """Register a check. Ids are stable: they appear in `diagnose --json`, report.json flags and docs/checks.md."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")

    def deco(fn: Callable[[object], Outcome]):
        if id in REGISTRY:
            raise ValueError(f"check id {id!r} registered twice")
        REGISTRY[id] = Check(id, level, meaning, fix, fn)
        return fn

    return deco


def ordered() -> list[Check]:
    """The registered checks in `ORDER` (any check not listed there after them, in registration order)."""
    pos = {c: i for i, c in enumerate(ORDER)}
    return sorted(REGISTRY.values(), key=lambda c: pos.get(c.id, len(ORDER)))


def run_checks(ctx, ids: Optional[list[str]] = None) -> list[CheckResult]:
    """Run the registered checks (all, or `ids`) in `ORDER`."""
    out = []
    for c in ordered():
        if ids is not None and c.id not in ids:
            continue
        try:
            o = c.fn(ctx)
        except Unavailable as u:
            if u.owner == c.id:
                o = failed(u.message, u.fix, u.level)
            else:
                what = f" ({u.what})" if u.what else ""
                o = skipped(f"skipped: a prerequisite did not load{what}; see {u.owner}")
        except GradianError as e:  # a loader this check called directly
            o = failed(str(e))
        if o.status == "skip" and not o.message.startswith("skipped"):
            o.message = "skipped: " + o.message
        out.append(CheckResult(
            c.id, o.level or c.level, o.status, o.message, (o.fix if o.fix is not None else c.fix) if o.status == "fail" else "",
        ))
    return out
