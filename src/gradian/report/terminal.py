"""What the terminal shows: the typed report's summary and ranking, verify's and fidelity's tables (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..verdict import Verdict
from .banner import ranking_caption
from .schema import Report

_VERDICT_STYLE = {Verdict.attributed: "green", Verdict.declined: "yellow", Verdict.smoke_test: "magenta"}
_LEVEL_STYLE = {"error": "red", "warning": "yellow", "info": "dim"}


def print_summary(report: Report, console: Console | None = None, rows: int = 10) -> None:
    """The typed report's capability, verdict, flags, top rows and accused count."""
    console = console or Console()
    cap = report.capability
    if cap is not None:
        lo, hi = cap.ci
        console.print(
            f"[bold]capability[/bold] {cap.metric}: base {cap.base:.3f} -> tuned {cap.tuned:.3f}, "
            f"delta {cap.delta:+.3f} ({int(cap.confidence * 100)}% CI [{lo:+.3f}, {hi:+.3f}], n={cap.n})"
        )
    console.print(f"[bold {_VERDICT_STYLE[report.verdict]}]verdict: {report.verdict}[/] — {report.verdict_text}")
    for f in report.flags:
        console.print(f"  [{_LEVEL_STYLE[f.level]}]{f.level}[/] {f.id}: {f.message}")
    if report.ranking:
        planted = set(report.truth.planted or ()) if report.truth is not None else set()
        t = Table(title=ranking_caption(report).title, show_lines=False)
        for col in ("rank", "position", "score", "base loss", "tuned loss", "preview"):
            t.add_column(col, justify="right" if col not in ("preview",) else "left", overflow="fold")
        for r in report.ranking[:rows]:
            mark = " [red]*planted*[/]" if r.position in planted else ""
            t.add_row(str(r.rank), str(r.position), f"{r.score:.4g}", _fmt(r.base_loss), _fmt(r.tuned_loss),
                      _escape(r.preview[:90]) + mark)
        console.print(t)
    acc = report.accused
    if acc is not None and report.verdict is Verdict.attributed:
        console.print(f"[bold]accused:[/] {acc.count} row{'' if acc.count == 1 else 's'}. {acc.rule}")


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _escape(s: str) -> str:
    from rich.markup import escape

    return escape(s)


def print_verify(res: dict, console) -> None:
    t = Table(title=f"verify: retrained with the same recipe ({res['metric']}, base {res['base']:.3f}, "
                    f"fine-tuned {res['tuned']:.3f})")
    for col in ("retrained without", "capability", "reverted", "interval (reverted)", "difference vs fine-tune"):
        t.add_column(col, justify="left" if col == "retrained without" else "right")

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    def row(label, d):
        lo, hi = d["ci"]
        dlo, dhi = d["difference_ci"]
        t.add_row(label, f"{d['capability']:.3f}", pct(d["reverted_fraction"]), f"[{pct(lo)}, {pct(hi)}]",
                  f"{d['difference']:+.3f} [{dlo:+.3f}, {dhi:+.3f}]")

    row(f"top {res['top_k']} accused", res["accused"])
    for i, c in enumerate(res["controls"], start=1):
        row(f"{res['top_k']} random (control {i})", c)
    if res["control_mean_reverted"] is not None:
        t.add_row("mean of controls", "", pct(res["control_mean_reverted"]), "", "")
    console.print(t)
    ref = res.get("reference")
    if ref:
        wd = ref.get("weight_distance")
        dist = f"; its LoRA weights are {wd:.2%} from your adapter's" if wd is not None else ""
        console.print(("reference retrain (nothing dropped) reproduces the adapter bit for bit"
                       if ref["reproduced_bit_for_bit"] else
                       f"reference retrain differs from the adapter ({res['metric']} {ref['capability']:.3f} vs "
                       f"{res['original_tuned']:.3f}{dist}); comparisons use the reference"), style="dim")
    rep = res.get("reproduction")
    if rep and res.get("verdict") == "not_confirmed":  # the other verdicts' statements say it
        console.print(f"reproduction: {rep['reason']}", style="dim", highlight=False)
    style = {True: "bold green", False: "bold red", None: "bold yellow"}[res["confirmed"]]
    console.print(res["statement"], style=style, highlight=False)


def print_fidelity(res: dict, console) -> None:
    def f(x):
        return "-" if x is None else f"{x:+.3f}"

    t = Table(title=f"fidelity: predicted vs actual change on deterministic retrains ({res['n_items']} failing items)")
    t.add_column("preconditioner")
    t.add_column("LOO Pearson", justify="right")
    t.add_column("LOO Spearman", justify="right")
    t.add_column("LDS (Spearman, mean over items)", justify="right")
    t.add_column("LDS of the items' mean", justify="right")
    oracle = (res.get("lds") or {}).get("truth_oracle")
    if oracle is not None:
        t.add_column("LDS / truth oracle", justify="right")
    for p in res.get("methods") or res["preconditioners"]:
        lo = (res.get("loo") or {}).get("by_preconditioner", {}).get(p, {})
        ld = (res.get("lds") or {}).get("by_preconditioner", {}).get(p, {})
        label = p + (" (optimizer-aware)" if p == "adamw" else "")
        cells = [label, f(lo.get("pearson")), f(lo.get("spearman")), f(ld.get("lds")), f(ld.get("aggregate_spearman"))]
        if oracle is not None:
            cells.append("-" if ld.get("lds") is None or not oracle else f"{ld['lds'] / oracle:.2f}")
        t.add_row(*cells)
    if oracle is not None:
        t.add_row("truth oracle", "", "", f(oracle), "", "1.00")
    console.print(t)
    parts = []
    if res.get("loo"):
        parts.append(f"LOO on {res['loo']['n']} rows (top, bottom and random {res['loo']['rows_per_group']})")
    if res.get("lds"):
        parts.append(f"LDS over {res['lds']['subsets']} subsets of {res['lds']['subset_size']} rows removed"
                     + (f" (a predictor that knows the planted rows scores {res['lds']['truth_oracle']:+.3f})"
                        if res["lds"].get("truth_oracle") is not None else ""))
    ref = res["reference"]
    parts.append("the reference retrain reproduces the adapter bit for bit" if ref["reproduced_bit_for_bit"]
                 else "the reference retrain differs from the adapter; actual changes are measured against it")
    console.print("; ".join(parts) + f" ({res['timings']['retrains']} retrains, {res['timings']['total']:.0f}s)",
                  style="dim")


def print_checks(results, console=None) -> None:
    """`gradian diagnose`'s table and its one-line count."""
    from rich.markup import escape

    from ..checks.registry import LEVELS

    console = console or Console()
    t = Table(title="gradian diagnose", show_lines=False, expand=False)
    t.add_column("", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("level", no_wrap=True)
    t.add_column("message / fix", overflow="fold")
    colour = {"error": "red", "warning": "yellow", "info": "cyan"}
    for r in results:
        if r.status == "pass":
            mark, level, msg = "[green]ok[/]", f"[dim]{r.level}[/]", escape(r.message)
        elif r.status == "skip":
            mark, level, msg = "[dim]skip[/]", f"[dim]{r.level}[/]", f"[dim]{escape(r.message)}[/]"
        else:
            mark, level = f"[bold {colour[r.level]}]FAIL[/]", f"[{colour[r.level]}]{r.level}[/]"
            msg = escape(r.message) + (f"\n[bold]fix:[/] {escape(r.fix)}" if r.fix else "")
        t.add_row(mark, r.id, level, msg)
    console.print(t)
    n = {lvl: sum(1 for r in results if r.status == "fail" and r.level == lvl) for lvl in LEVELS}
    skips = sum(1 for r in results if r.status == "skip")
    console.print(f"{len(results)} checks: {n['error']} error(s), {n['warning']} warning(s), {n['info']} info, "
                  f"{skips} skipped" + (" — fix the errors before `gradian attribute`" if n["error"] else ""))
