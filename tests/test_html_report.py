"""report.html: content, escaping, self-containment, atomic writes, and a real headless-browser check.

The browser tests use Debian's chromium (`.ci/run` installs it); they are skipped with a reason when it is
missing. Each launches chromium once, headless, with a throwaway profile, and reads the DOM after load
(`--dump-dom`), so scripts and `onerror` handlers injected through training text would have run by then.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from gradian.errors import DataError, GradianError
from gradian.report.html import environment as _environment, load_run, render_html, write_html, write_run_html
from gradian.report.sections import split_span
from gradian.verdict import Verdict

FIXTURE = Path(__file__).parent / "fixtures" / "report_sample.json"
TEMPLATE = Path(__file__).parents[1] / "src" / "gradian" / "report" / "templates" / "report.html.j2"
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
)

SCRIPT = "<script>document.title='PWNED'</script>"
IMG = "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"
CSP_RE = re.compile(r'<meta http-equiv="Content-Security-Policy"[^>]*>')

VERIFY = {
    "top_k": 20,
    "accused": {"capability": 0.85, "reverted_fraction": 0.9, "ci": [0.7, 1.0]},
    "controls": [{"capability": 0.625, "reverted_fraction": 0.0}, {"capability": 0.65, "reverted_fraction": 0.1}],
    "control_mean_reverted": 0.05,
    "confirmed": True,
    "statement": "Dropping the 20 accused rows and retraining restored 90% of the lost exact_match; "
    "dropping 20 random rows restored 5%.",
}


@pytest.fixture()
def sample() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def declined(report: dict) -> dict:
    r = copy.deepcopy(report)
    r["verdict"] = "declined"
    r["verdict_text"] = "exact_match did not change measurably after fine-tuning, so gradian accuses no rows."
    r["capability"].update(delta=-0.025, tuned=0.85, ci=[-0.1, 0.05], significant=False,
                           min_detectable_delta=0.19)
    r["ranking"], r["clusters"], r["spans"] = [], [], []
    r["query"]["items"] = []
    r.pop("truth"), r.pop("metrics")
    return r


def smoke(report: dict) -> dict:
    r = copy.deepcopy(report)
    r["verdict"] = "smoke_test"
    r["verdict_text"] = "Smoke test: evaluation.require_significant is false, so the ranking was computed anyway."
    return r


def minimal(verdict: str = "declined", **keys) -> dict:
    """A report with only the keys gradian.report/1 requires (every optional one absent), then `keys`."""
    return {"schema": "gradian.report/1", "verdict": verdict, "verdict_text": "", "flags": [], "settings": {},
            "capability": None, "query": {"formulation": "contrastive", "items": []}, "index": None, "ranking": [],
            "clusters": [], "spans": [], "scores_summary": {"n": 0}, "timings": {}, **keys}


def ranked_row(position: int, text: str, **keys) -> dict:
    """A ranking row with only its required keys, then `keys`."""
    return {"rank": 1, "position": position, "id": f"train-{position:06d}-abc", "score": 2.5, "preview": text,
            "text": text, "base_loss": 1.0, "tuned_loss": 0.5, **keys}


def hostile(report: dict) -> dict:
    """Every piece of training and eval text replaced by markup that would run if it were not escaped."""
    r = copy.deepcopy(report)
    evil = f"Sure! {SCRIPT} and {IMG} done."
    for row in r["ranking"]:
        row["text"] = evil
        row["preview"] = evil
        row["id"] = f"train-{row['position']:06d}-{IMG}"
        start = evil.index("<script>")
        row["top_span"] = {"start": start, "end": start + len(SCRIPT), "text": SCRIPT, "score": 1.0}
    for it in r["capability"]["items"]:
        it["prompt"] = f"Q {SCRIPT} {IMG}"
        it["expected"] = IMG
        it["generated"] = SCRIPT
        it["base_generated"] = IMG
    for it in r["query"]["items"]:
        it["prompt"] = f"Q {SCRIPT}"
        it["generated"] = IMG
    for c in r["clusters"]:
        c["preview"] = evil
    for s in r["spans"]:
        s["text"] = SCRIPT
    r["flags"][0]["message"] = evil
    r["flags"][0]["fix"] = IMG
    r["verdict_text"] = evil
    r["capability"]["metric"] = SCRIPT
    r["settings"]["data"]["train"] = IMG
    r["index"]["key"] = SCRIPT
    r["timings"][SCRIPT] = 1.0
    return r


# ------------------------------------------------------------------------------------------------ helpers


class _Attrs(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.attrs: list[tuple[str, str, str]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for k, v in attrs:
            self.attrs.append((tag, k, v or ""))

    handle_startendtag = handle_starttag


def parse(html: str) -> _Attrs:
    p = _Attrs()
    p.feed(html)
    p.close()
    return p


def chromium(html: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """Load the page in headless chromium from a file:// URL; return the DOM after load."""
    page = tmp_path / "report.html"
    page.write_text(html, encoding="utf-8")
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-extensions", "--mute-audio", f"--user-data-dir={tmp_path / 'profile'}",
    ]
    if screenshot is not None:
        cmd += [f"--screenshot={screenshot}", "--window-size=1280,4000"]
    cmd += ["--dump-dom", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "</html>" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def dom_title(dom: str) -> str:
    m = re.search(r"<title>(.*?)</title>", dom, re.S)
    return m.group(1) if m else ""


# ------------------------------------------------------------------------------------------------ content


def test_fixture_renders_every_section(sample):
    html = render_html(sample, verify=VERIFY)
    assert html.startswith("<!DOCTYPE html>")
    for sid in ("verdict", "flags", "capability", "accused", "verify", "scores", "clusters", "spans", "query",
                "index", "settings"):
        assert f'id="{sid}"' in html, sid
    assert 'id="plot-capability"' in html and 'id="plot-scores"' in html
    assert "Attributed" in html
    for row in sample["ranking"][:5]:
        assert row["id"] in html
    # Planted rows are marked, and the one outside the top 7 is still found in the list.
    planted = set(sample["truth"]["planted"])
    found = sum(1 for r in sample["ranking"] if r["position"] in planted)
    assert html.count('<span class="badge b-planted">planted</span>') == found + 1  # + the legend
    assert "<mark" in html
    # Flags show with their fixes; the warning comes before the infos.
    assert html.index("adapter.skipped_modules") < html.index("memory.logit_upcast")
    assert "Set grads.module_filter to include lm_head" in html
    # Index, fidelity, settings, timings.
    assert "37.5 MiB" in html and "rademacher" in html and "spearman_vs_exact" in html
    assert "Qwen/Qwen2.5-0.5B-Instruct" in html and "5 min 12 s" in html
    assert "None:" not in html  # every section of this report has content


def test_render_is_deterministic(sample):
    assert render_html(sample, verify=VERIFY) == render_html(sample, verify=VERIFY)


def test_declined_banner_gives_interval_and_minimum_detectable_delta(sample):
    html = render_html(declined(sample))
    assert "Declined: no attribution" in html
    assert "tone-declined" in html
    assert "[-0.1, 0.05]" in html and "includes zero" in html
    assert "smallest change this eval set can reliably detect is about 0.19" in html
    assert "None: no training rows are accused (the verdict is declined)." in html
    assert "None: no clusters were found." in html
    assert "None: no spans were scored." in html


def test_smoke_test_banner(sample):
    html = render_html(smoke(sample))
    assert "Smoke test: not evidence" in html and "tone-smoke" in html
    assert "Smoke test: evaluation.require_significant is false" in html


def test_the_ranking_says_what_its_rows_are(sample):
    """A smoke test's rows are its largest gradients: neither the page nor the terminal says they pushed the model
    toward anything; an attributed run's do, toward the failure (a regression) or the fixed answers (an
    improvement)."""
    import io

    from rich.console import Console

    from gradian.report.read import report_from
    from gradian.report.terminal import print_summary

    def shown(r: dict) -> tuple[str, str]:
        out = io.StringIO()
        print_summary(report_from(r), Console(file=out, width=300))
        return render_html(r), out.getvalue()

    for text in shown(smoke(sample)):
        assert "pushed the model" not in text
        assert "largest gradients" in text
    no_index = dict(smoke(sample), index=None)  # the one pass and a smoke test build no index
    assert f"of {sample['scores_summary']['n']} training rows" in render_html(no_index)
    html, term = shown(sample)
    assert "pushed the model toward the failure on the failing items" in html
    assert "training rows that pushed the model toward the failure" in term
    fixed = copy.deepcopy(sample)
    fixed["query"]["direction"] = "improvement"
    html, term = shown(fixed)
    assert "toward the answers the fine-tune fixed on the fixed items" in html and "the failure" not in term


def test_minimal_and_sparse_reports_render():
    html = render_html(minimal())
    assert "Declined: no attribution" in html
    assert "None: no capability measurement" in html
    assert "no score distribution in this report" in html
    assert "None: no fidelity measurement" in html
    sparse = minimal(
        "attributed", ranking=[ranked_row(3, "hi")],
        capability={"metric": "contains", "n": 0, "base": 0.5, "tuned": 0.1, "delta": -0.4, "ci": [-0.5, -0.3],
                    "confidence": 0.95, "significant": True, "min_detectable_delta": float("inf"), "items": []},
        index={"key": "k", "examples": 10, "dim": 8, "dtype": "float32", "bytes": 320, "projection": None},
        scores_summary={"n": 10, "histogram": {"edges": [], "counts": []}}, timings={"index": 1.5},
        settings={"nested": {}})
    html = render_html(sparse)
    assert "train-000003-abc" in html and "none (exact LoRA gradients)" in html
    assert "no score distribution in this report" in html


@pytest.mark.parametrize("key,value,named", [
    ("flags", None, "key flags"), ("timings", {"index": "n/a"}, "key timings.index"),
    ("ranking", [{"rank": 1, "position": 3, "id": "x", "score": 1.0}], "key ranking.0."),
    ("verdict", "something_new", "key verdict"), ("schema", "gradian.report/2", "key schema")])
def test_a_report_off_the_schema_is_refused_naming_the_key(key, value, named):
    # the page reads the typed report: what does not validate is an error naming the key, not a page of dashes
    with pytest.raises(DataError, match=re.escape(named)):
        render_html(minimal(**{key: value}))


def test_unchanged_items_fold_away(sample):
    html = render_html(sample)
    changed = html[html.index('id="items-table"'):html.index('id="items-same-table"')]
    assert changed.count('class="st-regressed"') == 11 and changed.count('class="st-same"') == 0
    assert "28 unchanged items" in html


def test_all_scores_draw_the_histogram_and_place_missed_planted_rows(sample):
    r = copy.deepcopy(sample)
    scores = np.linspace(-1, 1, r["index"]["examples"])
    for row in r["ranking"]:
        scores[row["position"]] = row["score"]
    missing = next(p for p in range(r["index"]["examples"]) if p not in {x["position"] for x in r["ranking"]})
    r["truth"]["planted"].append(missing)
    html = render_html(r, scores=scores)
    assert 'id="plot-scores"' in html and "no score distribution" not in html
    assert f"position {missing} at rank" in html


def test_attributed_run_that_accuses_nobody_says_so(sample):
    # an attributed verdict whose rule passes no row (Gemma-3's entity-first fine-tune, bench/README.md): the page
    # must not call the top rows accused nor speak of "the first 0 rows"
    def with_accused(count: int) -> dict:
        r = copy.deepcopy(sample)
        r["accused"] = {"count": count, "positions": [x["position"] for x in r["ranking"][:count]],
                        "z_threshold": 6.0, "median": None, "scale": None, "capped_at_top_k": False,
                        "rule": "rows above the widest drop, more than 6 robust standard deviations out",
                        "evidence": [{"position": x["position"], "items": [4, 5], "statistic": 30.0 + i,
                                      "threshold": 12.5, "item_z": 25.0} for i, x in enumerate(r["ranking"][:count])]}
        if count:
            r["accused"].update(threshold=12.5, drop=2.0)
        for i, row in enumerate(r["ranking"]):
            row["accused"] = i < count
        return r

    html = render_html(with_accused(0))
    rule = html[html.index('id="accused-rule"'):]
    rule = rule[:rule.index("</p>")]
    assert "No row is accused" in rule and "more than 6 robust" in rule and "candidates to read" in rule
    assert "The first 0" not in html and "badge b-accused" not in html
    accusing = render_html(with_accused(3))
    assert "No row is accused" not in accusing and "3 of the" in accusing and "are accused" in accusing
    assert accusing.count("badge b-accused") == 3
    # each accused row carries its evidence: the items it explains and its statistic against the threshold
    assert accusing.count("explains eval items 4, 5: statistic") == 3 and "&gt; 12.5" in accusing


# ------------------------------------------------------------------------------------------------ spans


def test_split_span_offsets_and_fallbacks():
    assert split_span("abcdef", 2, 4, "cd") == ("ab", "cd", "ef")
    assert split_span("abcdef", 2, 4) == ("ab", "cd", "ef")
    # offsets that disagree with the span text: search for the text instead
    assert split_span("xx hello yy", 0, 2, "hello") == ("xx ", "hello", " yy")
    # nothing usable: no highlight
    assert split_span("abc", 5, 9, "zzz") == ("abc", "", "")
    assert split_span("abc", None, None) == ("abc", "", "")
    before, mid, after = split_span("a" * 10_000 + "SPAN" + "b" * 10_000, 10_000, 10_004, "SPAN")
    assert mid == "SPAN" and before.startswith("… ") and after.endswith(" …") and len(before) < 2000


def test_span_parts_are_escaped_separately():
    text = "a<b>c & <i>d</i>"
    r = minimal("attributed", ranking=[
        ranked_row(0, text, top_span={"start": 1, "end": 4, "text": "<b>", "score": 0.5})])
    html = render_html(r)
    assert re.search(r'>a<mark[^>]*>&lt;b&gt;</mark>c &amp; &lt;i&gt;d&lt;/i&gt;<', html)
    assert "a<b>c" not in html and "<i>d</i>" not in html


# ------------------------------------------------------------------------------------------------ security


def test_autoescape_is_on_and_template_never_marks_data_safe():
    env = _environment()
    assert env.autoescape is True
    src = re.sub(r"\{#.*?#\}", "", TEMPLATE.read_text(encoding="utf-8"), flags=re.S)  # minus comments
    assert "|safe" not in src.replace(" ", "") and "autoescapefalse" not in src.replace(" ", "")
    assert "<script" not in src.lower()


def test_hostile_text_is_escaped_in_the_markup(sample):
    html = render_html(hostile(sample), verify=VERIFY)
    assert "<script" not in html.lower()
    assert "<img" not in html.lower()
    assert "onerror=" not in html.replace("onerror=&#34;", "")  # only as escaped text
    assert "&lt;script&gt;document.title=&#39;PWNED&#39;&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=&#34;document.body.setAttribute(&#39;data-pwned&#39;,&#39;1&#39;)&#34;&gt;" in html
    tags = set(parse(html).tags)
    assert not tags & {"script", "img", "iframe", "object", "embed", "link", "base", "form"}


def test_page_is_self_contained(sample):
    r = copy.deepcopy(sample)
    r["ranking"][0]["text"] += ' <a href="https://evil.example/">x</a> <img src="http://evil.example/p.png">'
    html = render_html(r, verify=VERIFY)
    p = parse(html)
    for tag, k, v in p.attrs:
        if k in {"src", "href", "xlink:href", "action", "poster", "data", "srcset", "background"}:
            assert not re.match(r"\s*(https?:)?//", v, re.I), (tag, k, v)
            if k == "href":
                assert v.startswith("#"), (tag, k, v)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*https?:""", html, re.I)
    assert "url(" not in html and "@import" not in html
    assert not {"script", "link", "iframe", "img"} & set(p.tags)
    csp = CSP_RE.search(html)
    assert csp and "default-src 'none'" in csp.group(0)


# ------------------------------------------------------------------------------------------------ files


def test_write_html_is_atomic(tmp_path, sample, monkeypatch):
    out = tmp_path / "run" / "report.html"
    assert write_html(sample, out, verify=VERIFY) == out
    assert out.read_text(encoding="utf-8") == render_html(sample, verify=VERIFY)
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html"]
    before = out.read_bytes()

    import gradian.io as gio

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gio.os, "replace", boom)
    with pytest.raises(RuntimeError):
        write_html(declined(sample), out)
    assert out.read_bytes() == before  # the old page survives a failed write
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.html"]  # and no temp file is left


def test_load_run_reads_the_run_dir(tmp_path, sample):
    with pytest.raises(GradianError, match="report.json"):
        load_run(tmp_path)
    (tmp_path / "report.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(GradianError, match="cannot be read as JSON"):
        load_run(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({**sample, "timings": None}), encoding="utf-8")
    with pytest.raises(GradianError, match="report.json: key timings"):
        load_run(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps(sample), encoding="utf-8")
    run = load_run(tmp_path)
    assert run.report.verdict is Verdict.attributed and run.verify is None and run.fidelity is None
    assert run.scores is None

    (tmp_path / "verify.json").write_text(json.dumps(VERIFY), encoding="utf-8")
    (tmp_path / "fidelity.json").write_text(json.dumps({"lds": 0.41, "loo": {"pairs": 32, "spearman": 0.62}}))
    np.save(tmp_path / "scores.npy", np.linspace(-3, 3, sample["index"]["examples"]).astype(np.float32))
    run = load_run(tmp_path)
    assert run.verify["confirmed"] is True and run.fidelity["lds"] == 0.41
    assert run.scores.shape == (sample["index"]["examples"],)
    html = write_run_html(tmp_path).read_text(encoding="utf-8")
    assert "from fidelity.json" in html and "loo.spearman" in html and 'id="verify"' in html
    assert html == render_html(run.report, verify=run.verify, fidelity=run.fidelity, scores=run.scores)


def test_no_verify_section_without_verify(sample):
    html = render_html(sample)
    assert 'id="verify"' not in html and 'href="#verify"' not in html


# ------------------------------------------------------------------------------------------------ browser


@needs_chromium
def test_browser_renders_fixture_and_screenshot(tmp_path, sample):
    shot = tmp_path / "report.png"
    dom = chromium(render_html(sample, verify=VERIFY), tmp_path, screenshot=shot)
    assert "Attributed" in dom and sample["verdict_text"].split(";")[0] in dom
    assert re.search(r'<svg[^>]*id="plot-capability"', dom)
    assert re.search(r'<svg[^>]*id="plot-scores"', dom)
    for row in sample["ranking"][:3]:
        assert row["id"] in dom
    assert 'id="verify-result"' in dom
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 100_000  # a full 1280x4000 page of text, tables and plots, not a blank canvas


@needs_chromium
def test_browser_runs_nothing_from_training_text(tmp_path, sample):
    html = render_html(hostile(sample), verify=VERIFY)
    # Test the escaping on its own: take the CSP (the second line of defence) out of the page first.
    html = CSP_RE.sub("", html)
    assert "Content-Security-Policy" not in html
    dom = chromium(html, tmp_path)
    assert "PWNED" not in dom_title(dom)
    assert "data-pwned" not in dom.replace("&#39;data-pwned&#39;", "").replace("'data-pwned'", "")
    assert not re.search(r"<body[^>]*data-pwned", dom)
    # The payload shows as literal text.
    assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;" in dom
    assert "&lt;img src=x onerror=\"document.body.setAttribute('data-pwned','1')\"&gt;" in dom
    assert "<script" not in dom.lower() and "<img" not in dom.lower()


@needs_chromium
@pytest.mark.parametrize("kind", ["declined", "smoke_test"])
def test_browser_declined_and_smoke_banners(tmp_path, sample, kind):
    report = declined(sample) if kind == "declined" else smoke(sample)
    dom = chromium(render_html(report), tmp_path)
    m = re.search(r'<section id="verdict" class="banner tone-(\w+)" data-verdict="(\w+)">', dom)
    assert m and m.group(2) == kind
    if kind == "declined":
        assert "Declined: no attribution" in dom and "includes zero" in dom and "about 0.19" in dom
    else:
        assert "Smoke test: not evidence" in dom and "not as a finding" in dom


@needs_chromium
def test_browser_shows_verify_when_given(tmp_path, sample):
    v = copy.deepcopy(VERIFY)
    v.update(confirmed=False, statement="Dropping the accused restored 4% of the change; random rows restored 3%.")
    dom = chromium(render_html(sample, verify=v), tmp_path)
    assert 'id="verify"' in dom and "Not confirmed" in dom and "restored 4% of the change" in dom
    assert "tone-declined" in dom[dom.index('id="verify-result"') - 60:]


@needs_chromium
def test_browser_csp_alone_blocks_injected_markup(tmp_path, sample, monkeypatch):
    """Second line of defence: with escaping deliberately broken, the page's CSP still runs nothing."""
    import gradian.report.html as hr

    real = hr.environment

    def unescaped():
        env = real()
        env.autoescape = False
        return env

    monkeypatch.setattr(hr, "environment", unescaped)
    html = render_html(hostile(sample))
    assert SCRIPT in html  # escaping really is off in this test
    dom = chromium(html, tmp_path)
    assert "PWNED" not in dom_title(dom)
    assert not re.search(r"<body[^>]*data-pwned", dom)
