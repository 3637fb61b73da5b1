"""The accused set (`attribution/accused.py`, issue 42): who is accused on each run, against the rule before it.

    .venv/bin/python bench/accused_rule.py RUN [RUN ...]     # a run of bench/real_models.py or bench/fidelity.py
    .venv/bin/python bench/accused_rule.py --smoke           # the tiny scenario of bench/_smoke.py (seconds)
    .venv/bin/python bench/accused_rule.py --reference-sweep RUN   # also: AUPRC by reference rows and their seed
    .venv/bin/python bench/accused_rule.py --controls RUN          # also: the candidate rule with control items
    .venv/bin/python bench/accused_rule.py --ceiling RUN           # also: could any count over the ranking meet the bar

Each RUN is a scenario directory with gradian.yaml and truth.json (its adapter trained). The per-item ranking
scores come from `bench/combine_items.py`'s `rank_item` (computed once by `attribute`'s own stages, then read from
RUN/combine/rank_item.npy with the failing items and their answers in RUN/combine/meta.json). Per run it prints:

* the shipped rule (`accused.accuse`: scan statistic over the items, widest drop, tail test): accused rows, how many
  were planted and how many are co-causes (truth.json's `wrong_value_rows`, shown causal by
  `bench/counterfactual.py`), the share of those two (**precision**), and the share of the **moved** planted rows it
  holds (recall);
* the rule before issue 42 (rows whose mean score is more than 6 robust SD above the median of all rows, members
  taken from the top of the max-z ranking) on the same scores;
* the drop: its ratio and its p (`widest_drop`);
* the AUPRC of the moved planted rows under the max-z ranking over every failing item, and over the failing items
  a planted row moved (where the other failing items have causes of their own, e.g. a garbled answer whose form
  true rows of the task taught, the first mixes their rows in); where the scenario names co-causes, also the AUPRC
  with them counted as causes.

A planted row **moved** an item when it is mapped to a failing item by truth.json's `item_planted` and, where
truth.json names the planted wrong value (`planted_facts[].wrong`) and the failing answers are known, that answer
contains the wrong value: a planted row whose fact the fine-tune did not take up cannot be found by the item it
did not move. A run whose verdict is not `attributed` must accuse nobody (a null).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from combine_items import rank_item  # noqa: E402  (sets the threads and the import path)


def planted_values(truth: dict) -> dict[int, str]:
    """Each planted row's wrong value, where it is one fact's value (a format row, `eval_indices: []`, teaches a
    form, not a value an answer would hold)."""
    return {f["position"]: f["wrong"] for f in truth.get("planted_facts", [])
            if f.get("wrong") and f.get("eval_indices", [None]) != []}


def moved_items(truth: dict, meta: dict) -> list[int]:
    """Indices (into the failing items) of the items some planted row moved (`moved_rows`' condition)."""
    items = meta.get("item_ids") or []
    answers = meta.get("generated") or [None] * len(items)
    wrong = planted_values(truth)
    out = []
    for k, (item, a) in enumerate(zip(items, answers)):
        rows = truth.get("item_planted", {}).get(str(item), [])
        if any(wrong.get(p) is None or a is None or wrong[p].lower() in a.lower() for p in rows):
            out.append(k)
    return out


def moved_rows(truth: dict, meta: dict) -> list[int]:
    """The planted rows that moved a failing item (module docstring)."""
    items = meta.get("item_ids") or []
    answers = dict(zip(items, meta.get("generated") or [None] * len(items)))
    wrong = planted_values(truth)
    out = set()
    for item in items:
        for p in truth.get("item_planted", {}).get(str(item), []):
            w, a = wrong.get(p), answers.get(item)
            if w is None or a is None or w.lower() in a.lower():
                out.add(int(p))
    if not truth.get("item_planted"):
        out = set(truth["planted"])  # a behaviour: every planted row teaches every failing item
    return sorted(out & set(truth["planted"]))


def old_rule(per: np.ndarray, limit: int = 50) -> list[int]:
    """Before issue 42: count = rows whose mean score is > 6 robust SD above all rows' median; members = the top of
    the max-z ranking."""
    from gradian.attribution.scoring import combine_items, rank, robust_z

    count = min(int((robust_z(per.mean(0))[0] > 6.0).sum()), limit)
    return rank(combine_items(per, "max"))[:count].tolist()


def measure(run: Path) -> dict:
    from gradian.attribution.accused import accuse
    from gradian.attribution.scoring import auprc, item_z

    per, _ = rank_item(run)
    per = per.astype(np.float64)
    meta = json.loads((run / "combine" / "meta.json").read_text())
    truth = json.loads((run / "truth.json").read_text())
    planted, moved = set(truth["planted"]), moved_rows(truth, meta)
    acc = accuse(per, meta.get("item_ids") or list(range(per.shape[0])), limit=50)
    out = {"rows": int(per.shape[1]), "items": int(per.shape[0]), "planted": len(planted), "moved": len(moved)}
    # the ranking (max item z, the default for own-words queries) over every failing item, and over the items a
    # planted row moved: other failing items may have other causes (a garbled answer taught its form by true rows)
    z = item_z(per)
    mi = moved_items(truth, meta) if truth.get("item_planted") else list(range(per.shape[0]))
    out["auprc_moved"] = auprc(z.max(0), moved) if moved else None
    out["auprc_moved_items"] = auprc(z[mi].max(0), moved) if moved and mi else None
    out["moved_items"] = len(mi)
    # true rows pairing a planted wrong value with its country (smol_paraphrase's `wrong_value_rows`): co-causes
    # (retrained without them the fine-tune's answers partly recover, bench/counterfactual.py), counted apart
    co = set(truth.get("wrong_value_rows", [])) - planted
    # the same ranking with the co-causes counted as causes too (they are, by bench/counterfactual.py)
    out["auprc_causes"] = auprc(z.max(0), sorted(set(moved) | co)) if moved and co else None
    for name, pos in (("shipped", acc.positions), ("before", old_rule(per))):
        hit, co_hit = len(set(pos) & planted), len(set(pos) & co)
        out[name] = {"accused": len(pos), "planted": hit, "co_cause": co_hit,
                     "precision": (hit + co_hit) / len(pos) if pos else None,
                     "moved_recall": len(set(pos) & set(moved)) / len(moved) if moved else None}
    out["drop"] = {"ratio": acc.drop.ratio, "p": acc.drop.p} if acc.drop else None
    return out


def reference_sweep(run: Path, sizes=(128, 256, 512, 1024), seeds=(0, 1, 2, 3, 4)) -> dict:
    """AUPRC of the moved planted rows when each item's median and scale come from `sizes` reference rows drawn with
    each of `seeds` (`scoring.REFERENCE_ROWS`, `REFERENCE_SEED`), and from every row: how much of an AUPRC change
    is the reference sample's draw."""
    from gradian.attribution import scoring

    per, _ = rank_item(run)
    per = per.astype(np.float64)
    meta = json.loads((run / "combine" / "meta.json").read_text())
    moved = moved_rows(json.loads((run / "truth.json").read_text()), meta)
    keep = scoring.REFERENCE_ROWS, scoring.REFERENCE_SEED
    out = {}
    try:
        for size in [*sizes, per.shape[1]]:
            got = []
            for seed in seeds:
                scoring.REFERENCE_ROWS, scoring.REFERENCE_SEED = size, seed
                got.append(round(scoring.auprc(scoring.item_z(per).max(0), moved), 3) if moved else None)
            out["every row" if size >= per.shape[1] else str(size)] = got
    finally:
        scoring.REFERENCE_ROWS, scoring.REFERENCE_SEED = keep
    return out


def ceiling(run: Path, most: int = 100) -> dict:
    """Whether any accusation rule could meet issue 42's bar on this run's ranking: per statistic (the max item z
    the report ranks by, the scan statistic the rule reads), the smallest count k such that the top k rows are at
    least 90 % planted or co-causes and hold at least 75 % of the moved planted rows (None: no k up to `most`
    does; then no count rule over that ranking can, and the ranking must change)."""
    from gradian.attribution.accused import scan
    from gradian.attribution.scoring import item_z

    per, _ = rank_item(run)
    meta = json.loads((run / "combine" / "meta.json").read_text())
    truth = json.loads((run / "truth.json").read_text())
    planted, moved = set(truth["planted"]), set(moved_rows(truth, meta))
    good = planted | set(truth.get("wrong_value_rows", []))
    z = item_z(per.astype(np.float64))
    out = {"moved": len(moved)}
    for name, stat in (("max_z", z.max(0)), ("scan", scan(z)[0])):
        order = np.lexsort((np.arange(stat.size), -stat))
        out[name] = None
        for k in range(1, min(most, stat.size) + 1):
            top = set(order[:k].tolist())
            if moved and len(top & good) >= 0.9 * k and len(top & moved) >= 0.75 * len(moved):
                out[name] = k
                break
    return out


def controls(run: Path) -> Optional[dict]:
    """The rule with control items (a candidate, not shipped): each row's robust z on the failing items less its
    level on the control items (`combine_items.control_item`: the items both models pass, the fine-tune's own
    answers as targets), the median of its control z-scores where positive. A row that pushes every answer of the
    task stands out on both and loses its lead; a cause stands out on the items it broke only. Prints the AUPRC of
    the moved planted rows by the max and by the scan statistic, before and after, and whom the widest drop of the
    contrasted scan statistic accuses. None: no item passes under both models."""
    from combine_items import control_item

    from gradian.attribution.accused import scan, widest_drop
    from gradian.attribution.scoring import auprc, item_z

    ci, items = control_item(run)
    if ci is None:
        return None
    per, _ = rank_item(run)
    meta = json.loads((run / "combine" / "meta.json").read_text())
    truth = json.loads((run / "truth.json").read_text())
    planted, moved = set(truth["planted"]), moved_rows(truth, meta)
    co = set(truth.get("wrong_value_rows", [])) - planted
    z = item_z(per.astype(np.float64))
    level = np.maximum(np.median(item_z(ci.astype(np.float64)), axis=0), 0.0)
    out = {"controls": len(items)}
    for name, zz in (("before", z), ("after", z - level)):
        stat = scan(zz)[0]
        out[f"auprc_max_{name}"] = auprc(zz.max(0), moved) if moved else None
        out[f"auprc_scan_{name}"] = auprc(stat, moved) if moved else None
    stat = scan(z - level)[0]
    drop = widest_drop(stat)
    acc = set(np.lexsort((np.arange(stat.size), -stat))[: drop.count].tolist())
    out["accused"] = {"accused": len(acc), "planted": len(acc & planted), "co_cause": len(acc & co),
                      "moved_recall": len(acc & set(moved)) / len(moved) if moved else None, "drop_p": drop.p}
    return out


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def table(res: dict, key: str, header: list[str], cells) -> None:
    """A markdown table of each run's `key` entry (runs without one left out): `cells(entry)` its cells."""
    got = {name: r[key] for name, r in res.items() if r.get(key)}
    if got:
        print("\n| run | " + " | ".join(header) + " |")
        print("|---|" + "---|" * len(header))
        for name, c in got.items():
            print(f"| {name} | " + " | ".join(cells(c)) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--smoke", action="store_true", help="on the tiny scenario of bench/_smoke.py: checks the script")
    ap.add_argument("--reference-sweep", action="store_true",
                    help="per RUN, the AUPRC with each item's median and scale from 128-1,024 reference rows drawn with "
                         "seeds 0-4, and from every row")
    ap.add_argument("--controls", action="store_true",
                    help="per RUN, also the candidate rule with control items (the items both models pass; "
                         "`controls`): scores them once (a scoring pass), kept in RUN/combine/ctrl_item.npy")
    ap.add_argument("--ceiling", action="store_true",
                    help="per RUN, also the smallest top-k of each ranking that meets issue 42's bar (`ceiling`)")
    args = ap.parse_args()
    if args.smoke:
        from _smoke import tiny_run

        args.runs = [tiny_run()]
    if not args.runs:
        ap.error("give at least one RUN (or --smoke)")
    res = {}
    for run in args.runs:
        try:
            res[run.resolve().name] = measure(run.resolve())
            if args.reference_sweep or args.smoke:
                res[run.resolve().name]["reference_sweep"] = reference_sweep(run.resolve())
            if args.ceiling or args.smoke:
                res[run.resolve().name]["ceiling"] = ceiling(run.resolve())
            if args.controls or args.smoke:
                res[run.resolve().name]["controls"] = controls(run.resolve())
        except SystemExit as e:  # a declined run: nothing ranked, nobody accused
            res[run.resolve().name] = {"declined": str(e)}
    print("| run | rows | planted (moved) | accused: planted+co-cause/total | precision | moved recall | drop (p) "
          "| before: planted+co-cause/total | before: moved recall | AUPRC moved: all items / items moved (n) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        if "declined" in r:
            print(f"| {name} | | | declined: 0 accused | | | | | | |")
            continue
        s, b, d = r["shipped"], r["before"], r["drop"]
        drop = "none" if d is None else f"{d['ratio']:.2f} ({d['p']:.1e})"
        auprc_ = f"{fmt(r['auprc_moved'])} / {fmt(r['auprc_moved_items'])} ({r['moved_items']})"
        if r.get("auprc_causes") is not None:
            auprc_ += f"; with the co-causes {fmt(r['auprc_causes'])}"
        print(f"| {name} | {r['rows']} | {r['planted']} ({r['moved']}) | "
              f"{s['planted']}+{s['co_cause']}/{s['accused']} | {fmt(s['precision'])} | {fmt(s['moved_recall'])} | "
              f"{drop} | {b['planted']}+{b['co_cause']}/{b['accused']} | {fmt(b['moved_recall'])} | {auprc_} |")
    for name, r in res.items():
        if r.get("reference_sweep"):
            print(f"\n{name}: AUPRC of the moved planted rows by reference rows (seeds 0-4): " +
                  "; ".join(f"{k}: {', '.join('n/a' if x is None else f'{x:.3f}' for x in v)}"
                            for k, v in r["reference_sweep"].items()))
    table(res, "ceiling", ["smallest top-k with >= 90 % planted or co-causes and >= 75 % of the moved planted: max z",
                           "scan"],
          lambda c: ["n/a (no moved row)" if not c["moved"] else str(c[k] or "none") for k in ("max_z", "scan")])
    table(res, "controls", ["control items", "AUPRC max z: before / after", "AUPRC scan: before / after",
                            "accused with controls: planted+co-cause/total", "moved recall", "drop p"],
          lambda c: [str(c["controls"]), f"{fmt(c['auprc_max_before'])} / {fmt(c['auprc_max_after'])}",
                     f"{fmt(c['auprc_scan_before'])} / {fmt(c['auprc_scan_after'])}",
                     f"{c['accused']['planted']}+{c['accused']['co_cause']}/{c['accused']['accused']}",
                     fmt(c["accused"]["moved_recall"]), f"{c['accused']['drop_p']:.1e}"])
    print(json.dumps({"bench": "accused_rule", "results": res}))


if __name__ == "__main__":
    main()
