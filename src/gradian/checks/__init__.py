"""`gradian diagnose`: setup checks with stable ids, run before anything costly, and again by `attribute` on what it
loaded.

The checks live one module per concern (`setup_checks`, `data`, `model`, `adapter`, `convergence`, `evaluation`,
`resources`, `capture`), registered with `registry.check`; they look at a `context.Context` that loads through the
same loaders every verb uses. Calling them from code:

    results = run_diagnose("gradian.yaml", ["grads.batch_size=4"])    # what `gradian diagnose` prints
    results = run_checks_for_session(session)  # after open_session: raises CheckFailed on an error check and
                                               # puts the failed warnings/infos into session.log.flags (report flags)
"""

from __future__ import annotations

from typing import Optional

from ..config import load_config
from ..errors import CheckFailed
from . import adapter, capture, convergence, data, evaluation, model, resources, setup_checks  # noqa: F401 - they register the checks
from .context import Context
from .registry import LEVELS, ORDER, REGISTRY, STATUSES, CheckResult, ordered, run_checks

__all__ = ["Context", "CheckResult", "LEVELS", "ORDER", "REGISTRY", "STATUSES", "checks_markdown", "failed_errors",
           "flags_from_checks", "raise_on_errors", "run_checks", "run_checks_for_session", "run_diagnose"]


def run_diagnose(config_path, overrides: Optional[list[str]] = None) -> list[CheckResult]:
    """Load the config (ConfigError propagates: exit 2) and run every check; nothing is written."""
    cfg = load_config(config_path, overrides or [])
    return run_checks(Context(cfg))


def flags_from_checks(results: list[CheckResult]) -> list[dict]:
    """Failed warnings and infos as report.json flags: [{id, level, message, fix}]."""
    return [{"id": r.id, "level": r.level, "message": r.message, "fix": r.fix}
            for r in results if r.status == "fail" and r.level in ("warning", "info")]


def failed_errors(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status == "fail" and r.level == "error"]


def raise_on_errors(results: list[CheckResult]) -> None:
    errors = failed_errors(results)
    if errors:
        parts = [f"{r.id}: {r.message}" + (f" (fix: {r.fix})" if r.fix else "") for r in errors]
        raise CheckFailed(f"{len(errors)} setup check(s) failed, so nothing was attributed. " + " ".join(
            f"[{i}] {p}" for i, p in enumerate(parts, start=1)) + " Run `gradian diagnose CONFIG` to see every check.")


def run_checks_for_session(session) -> list[CheckResult]:
    """The checks over what `setup.session.open_session` loaded (nothing is reloaded but small config files).

    Failed warnings/infos go into `session.log.flags` (report.json `flags`); any failed error-level check raises
    CheckFailed (exit code 2) listing them, before anything is written.
    """
    results = run_checks(Context.from_session(session))
    for f in flags_from_checks(results):
        session.log.flag(f["id"], f["level"], f["message"], f["fix"])
    raise_on_errors(results)
    return results


def checks_markdown() -> str:
    """The check-id reference (docs/checks.md) generated from the registry."""
    lines = ["| id | level | meaning | fix |", "|---|---|---|---|"]
    for c in ordered():
        lines.append(f"| `{c.id}` | {c.level} | {c.meaning} | {c.fix} |")
    return "\n".join(lines)
