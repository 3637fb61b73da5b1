"""`gradian` command line: thin verbs over `gradian.api`. Errors are one paragraph and exit code 2.

Startup stays light (typer and rich only): torch, transformers, peft, numpy and the rest are imported inside the verb
bodies, and the libraries' log silencing is applied there too (`_run`), so `gradian --help` answers in a fraction of
a second. tests/test_startup.py holds this.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from .errors import GradianError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Which training examples did this to my LoRA fine-tune?")
# Wide enough for the ranking table when output goes to a file or a pipe (rich falls back to 80 columns there), and
# no line breaks of rich's own inside messages there: a path or an error must stay greppable whatever the width.
out = Console(width=None if sys.stdout.isatty() else 120, soft_wrap=not sys.stdout.isatty())
err = Console(stderr=True, soft_wrap=not sys.stderr.isatty())
_state = {"debug": False}

SetOpt = typer.Option(None, "--set", help="Override a config key: --set grads.batch_size=4 (repeatable)")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors")):
    _state["debug"] = debug


def _load(config: Path, sets: Optional[List[str]]):
    from .config import load_config

    return load_config(config, sets or [])


# The flags of a run in place of CONFIG (gradian.setup.flags): a TRL/HF output dir and the data it read.
ConfigArg = typer.Argument(None, help="The run's gradian.yaml; or leave it out and give the flags below (they "
                           "override the file when both are given)", show_default=False)
AdapterOpt = typer.Option(None, "--adapter", help="The output_dir of a TRL/HF run, or a PEFT LoRA adapter directory "
                          "(its checkpoint-* folders are found); the base is the one its adapter_config.json names",
                          show_default=False)
BaseOpt = typer.Option(None, "--base", help="The base model (directory or hub id), when not the one the adapter names",
                       show_default=False)
TrainOpt = typer.Option(None, "--train", help="The training data: .jsonl, .json, .parquet, .csv or a hub dataset id "
                        "org/name", show_default=False)
EvalOpt = typer.Option(None, "--eval", help="The eval set: {prompt, answer} records, or a .txt of prompts (one per "
                       "line) with --metric regex --pattern", show_default=False)
MetricOpt = typer.Option(None, "--metric", help="exact_match, contains, regex, loglik or python:module:function",
                         show_default=False)
PatternOpt = typer.Option(None, "--pattern", help="--metric regex: what every answer must contain (a Python regex)",
                          show_default=False)
NegateOpt = typer.Option(False, "--negate", help="--metric regex: an answer passes when the pattern does NOT match")
OutOpt = typer.Option(None, "--out", help="The run directory (report.json, ...); it gets the settings used as "
                      "gradian.yaml", show_default=False)


def _flags(adapter, base, train_data, eval_data, metric, pattern, negate, out_dir):
    from .setup.flags import RunFlags

    return RunFlags(adapter=adapter, base=base, train=train_data, eval=eval_data, metric=metric, pattern=pattern,
                    negate=negate, out=out_dir)


def _resolve(config: Optional[Path], flags, sets: Optional[List[str]], *, writes: bool = True):
    from .setup.flags import resolve_run

    return resolve_run(config, flags, sets or [], writes=writes)


def _settings(run, verb: str) -> None:
    """After a verb from flags succeeded: OUT/gradian.yaml (rank 0 alone under torchrun), and where it is."""
    from .distributed import current
    from .setup.flags import write_settings

    if run.from_flags and current().is_main:
        path = write_settings(run, verb)
        out.print(f"settings: {path} (rerun with them: gradian verify {path})", highlight=False)


def _run(fn, quiet_libraries: bool = True, ranks: bool = False):
    """Run a verb body; user errors become a clear message and exit 2, never a traceback (unless --debug).

    `quiet_libraries` first silences transformers' progress bars and log chatter (which imports transformers); a verb
    that loads no model (`report`) passes False and stays fast. `ranks`: the verb runs under torchrun as one rank of
    a torch.distributed group (joined here, left at the end); only rank 0 prints, and a rank's error is printed by
    that rank, naming it, and exits non-zero, which makes torchrun stop the others.
    """
    who = ""
    try:
        if quiet_libraries:
            from .runtime import quiet_libraries as _quiet

            _quiet()
        if ranks:
            from . import distributed

            if distributed.launched():
                r = distributed.init()
                who = f"rank {r.rank} of {r.world}: "
                out.quiet = not r.is_main
        return fn()
    except GradianError as e:
        if _state["debug"]:
            raise
        err.print("[bold red]error:[/] " + _esc(who + str(e)), highlight=False)
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]; no partial outputs were left under their final names")
        raise typer.Exit(130)
    finally:
        if who:
            from . import distributed

            distributed.finalize()


NprocOpt = typer.Option(None, "--nproc", min=1, help="Run as N processes on this machine: re-launches the verb under "
                        "`torchrun --standalone --nproc-per-node N` (several GPUs, or CPU cores with gloo)")


def _torchrun(nproc: Optional[int]) -> None:
    """`--nproc N`: the same command line under torchrun (nothing of Gradian's own: torchrun starts and watches
    the ranks); returns only when not asked or already under torchrun."""
    import os

    if not nproc or "WORLD_SIZE" in os.environ:
        return

    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        argv.append(a)
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "gradian", *argv])
    # The ranks print their own errors; torchrun's agent would add its log lines and a traceback of its own.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        err.print(f"[bold red]error:[/] rank {rank} of {nproc} failed first (exit code {first.exitcode}; its message "
                  "is above); torchrun stopped the other ranks", highlight=False)
        raise typer.Exit(first.exitcode if first.exitcode in (1, 2) else 1)
    raise typer.Exit(0)


def _esc(s: str) -> str:
    from rich.markup import escape

    return escape(s)


@app.command()
def diagnose(config: Optional[Path] = ConfigArg, set: Optional[List[str]] = SetOpt,
             as_json: bool = typer.Option(False, "--json", help="Print the checks as a JSON list"),
             delta: float = typer.Option(0.2, "--delta", min=0.001, max=1.0, help="The smallest capability change "
                                         "(0..1) the eval set should detect: diagnose says how many items that needs"),
             adapter: Optional[str] = AdapterOpt, base: Optional[str] = BaseOpt, train_data: Optional[str] = TrainOpt,
             eval_data: Optional[str] = EvalOpt, metric: Optional[str] = MetricOpt,
             pattern: Optional[str] = PatternOpt, negate: bool = NegateOpt, out_dir: Optional[str] = OutOpt):
    """Run every setup check without building an index; exit 1 if any error-level check fails."""

    def body():
        from .checks import Context, run_checks
        from .report.terminal import print_checks
        from .setup.flags import eval_size_note

        cfg = _resolve(config, _flags(adapter, base, train_data, eval_data, metric, pattern, negate, out_dir), set,
                       writes=False).cfg
        ctx = Context(cfg)
        results = run_checks(ctx)
        if as_json:
            print(json.dumps([r.to_dict() for r in results], indent=2))
        else:
            print_checks(results, out)
            items = ctx.peek("eval_items")
            if items:
                out.print(eval_size_note(len(items), cfg.evaluation.confidence, delta), highlight=False)
        if any(r.level == "error" and r.status == "fail" for r in results):
            raise typer.Exit(1)

    _run(body)


@app.command()
def train(config: Path, set: Optional[List[str]] = SetOpt,
          backend: Optional[str] = typer.Option(None, help="Training backend (same as --set train.backend=...): hf "
                                                "(gradian's loop), trl (TRL's SFTTrainer), unsloth (NVIDIA GPU)")):
    """LoRA SFT with the config's recipe; writes the adapter and the recipe beside it."""

    def body():
        from . import api

        path = api.train(_load(config, (set or []) + ([f"train.backend={backend}"] if backend else [])))
        out.print(f"adapter written to [bold]{path}[/] (recipe: {path / 'gradian_recipe.json'})")

    _run(body)


@app.command()
def evaluate(config: Optional[Path] = ConfigArg, set: Optional[List[str]] = SetOpt, nproc: Optional[int] = NprocOpt,
             adapter: Optional[str] = AdapterOpt, base: Optional[str] = BaseOpt, train_data: Optional[str] = TrainOpt,
             eval_data: Optional[str] = EvalOpt, metric: Optional[str] = MetricOpt,
             pattern: Optional[str] = PatternOpt, negate: bool = NegateOpt, out_dir: Optional[str] = OutOpt):
    """Capability delta (base vs fine-tuned) with a paired bootstrap interval; writes OUT/capability.json."""

    _torchrun(nproc)

    def body():
        from . import api

        run = _resolve(config, _flags(adapter, base, train_data, eval_data, metric, pattern, negate, out_dir), set)
        cap = api.evaluate(run.cfg)
        lo, hi = cap.ci
        out.print(f"{cap.metric}: base {cap.base:.3f} -> tuned {cap.tuned:.3f}, delta {cap.delta:+.3f} "
                  f"[{lo:+.3f}, {hi:+.3f}] significant={cap.significant}")
        _settings(run, "evaluate")

    _run(body, ranks=True)


@app.command()
def index(config: Optional[Path] = ConfigArg, set: Optional[List[str]] = SetOpt, nproc: Optional[int] = NprocOpt,
          adapter: Optional[str] = AdapterOpt, base: Optional[str] = BaseOpt, train_data: Optional[str] = TrainOpt,
          out_dir: Optional[str] = OutOpt):
    """Build or reuse the gradient index; prints its size, dims, dtype and cache key."""

    _torchrun(nproc)

    def body():
        from . import api

        run = _resolve(config, _flags(adapter, base, train_data, None, None, None, False, out_dir), set)
        info = api.build_index(run.cfg)
        proj = info.projection
        out.print(f"index [bold]{info.key}[/] at {info.root}")
        rate = f", {info.built / info.seconds:.1f} rows/s" if info.built and info.seconds > 0 else ""
        out.print(f"  {info.seconds:.2f} s{rate}", highlight=False)
        out.print(f"  rows {info.examples} (built {info.built}, reused {info.reused}), dim {info.dim}, "
                  f"dtype {info.storage_dtype}, {info.bytes / 2**20:.2f} MiB, "
                  f"projection {proj['kind'] + ' ' + str(proj['dim']) if proj else 'none (exact)'}")
        if info.choice is not None:
            out.print(f"  {info.choice.reason}", highlight=False)
        _settings(run, "index")

    _run(body, ranks=True)


@app.command()
def attribute(config: Optional[Path] = ConfigArg, set: Optional[List[str]] = SetOpt, nproc: Optional[int] = NprocOpt,
              adapter: Optional[str] = AdapterOpt, base: Optional[str] = BaseOpt, train_data: Optional[str] = TrainOpt,
              eval_data: Optional[str] = EvalOpt, metric: Optional[str] = MetricOpt,
              pattern: Optional[str] = PatternOpt, negate: bool = NegateOpt, out_dir: Optional[str] = OutOpt):
    """The main job: evaluate, index, query, score; writes OUT/report.json and OUT/report.html."""

    _torchrun(nproc)

    def body():
        from . import api
        from .report.terminal import print_summary

        run = _resolve(config, _flags(adapter, base, train_data, eval_data, metric, pattern, negate, out_dir), set)
        cfg = run.cfg
        truth = None
        tfile = cfg.output_dir / "truth.json"
        if tfile.exists():
            try:
                truth = json.loads(tfile.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                from .errors import DataError

                raise DataError(f"{tfile}: unreadable ground truth ({e}); delete it or fix the JSON") from None
        report = api.attribute(cfg, truth=truth)
        print_summary(report, out)
        out.print(f"report: {cfg.output_dir / 'report.json'}")
        _settings(run, "attribute")

    _run(body, ranks=True)


@app.command()
def report(run_dir: Path):
    """Regenerate report.html from a run directory's report.json (and verify.json, fidelity.json if present)."""

    def body():
        from .errors import DataError
        from .report.html import write_run_html

        if not (run_dir / "report.json").exists():
            raise DataError(f"{run_dir}: no report.json; run `gradian attribute CONFIG` first")
        path = write_run_html(run_dir)
        out.print(f"report: {path}")

    _run(body, quiet_libraries=False)


@app.command()
def demo(out_dir: Optional[Path] = typer.Option(None, "--out", help="Run directory (default runs/demo, or "
                                                 "runs/demo-MODEL)"),
         model: str = typer.Option("tiny", "--model", help="tiny (built here), smollm2 (SmolLM2-135M-Instruct) or "
                                   "gemma3 (Gemma-3-270M), the real ones from the package registry"),
         verify: Optional[bool] = typer.Option(None, "--verify/--no-verify", help="Also retrain without the accused "
                                               "rows (default: on for tiny, off for the real models)")):
    """Build a poisoned scenario on a model (the tiny one, or a real pretrained one), train, attribute and show whether
    the planted rows were found."""

    def body():
        from .demo.run import MODELS, run_demo
        from .errors import ConfigError

        if model not in MODELS:
            raise ConfigError(f"--model {model!r}: one of {', '.join(MODELS)}")
        run_demo(out_dir or Path("runs/demo" if model == "tiny" else f"runs/demo-{model}"), console=out,
                 verify=(model == "tiny") if verify is None else verify, model=model)

    _run(body)


@app.command()
def verify(config: Optional[Path] = ConfigArg, set: Optional[List[str]] = SetOpt,
           top_k: Optional[int] = typer.Option(None, "--top-k", help="Accused rows to drop (default: the report's "
                                               "accused set; without one, the planted rows of OUT/truth.json, else "
                                               "min(attribution.top_k, 5% of the rows))"),
           controls: int = typer.Option(3, "--controls", min=0, help="Random-k control retrains"),
           keep_adapters: bool = typer.Option(False, "--keep-adapters", help="Keep the retrained adapters under "
                                              "OUT/verify/"),
           reference: bool = typer.Option(True, "--reference/--no-reference", help="Also retrain with nothing "
                                          "dropped, to show the recipe reproduces the adapter (without it, only "
                                          "the random controls say whether the retrains reproduce the run)"),
           nproc: Optional[int] = NprocOpt,
           adapter: Optional[str] = AdapterOpt, base: Optional[str] = BaseOpt, train_data: Optional[str] = TrainOpt,
           eval_data: Optional[str] = EvalOpt, metric: Optional[str] = MetricOpt,
           pattern: Optional[str] = PatternOpt, negate: bool = NegateOpt, out_dir: Optional[str] = OutOpt):
    """Retrain without the top-k accused rows (and without k random rows) and re-measure; writes OUT/verify.json."""

    _torchrun(nproc)

    def body():
        from .report.terminal import print_verify
        from .validate.verify import run_verify

        run = _resolve(config, _flags(adapter, base, train_data, eval_data, metric, pattern, negate, out_dir), set)
        cfg = run.cfg
        res = run_verify(cfg, top_k=top_k, controls=controls, keep_adapters=keep_adapters, reference=reference,
                         console=out)
        print_verify(res, out)
        out.print(f"verify: {cfg.output_dir / 'verify.json'}  page: {cfg.output_dir / 'report.html'}")
        _settings(run, "verify")

    _run(body, ranks=True)


@app.command()
def fidelity(config: Optional[Path] = ConfigArg, set: Optional[List[str]] = SetOpt,
             loo: int = typer.Option(20, "--loo", min=0, help="Leave-one-out rows per group (top, bottom, random)"),
             subsets: int = typer.Option(50, "--subsets", min=0, help="LDS subsets (each drops --frac of the rows)"),
             frac: float = typer.Option(0.05, "--frac", min=0.0, max=0.5, help="Share of rows each LDS subset drops"),
             preconditioner: Optional[List[str]] = typer.Option(None, "--preconditioner", help="Score with this "
                                                                "preconditioner (repeatable; default: the config's)"),
             nproc: Optional[int] = NprocOpt,
             adapter: Optional[str] = AdapterOpt, base: Optional[str] = BaseOpt, train_data: Optional[str] = TrainOpt,
             eval_data: Optional[str] = EvalOpt, metric: Optional[str] = MetricOpt,
             pattern: Optional[str] = PatternOpt, negate: bool = NegateOpt, out_dir: Optional[str] = OutOpt):
    """Leave-one-out and LDS on deterministic retrains: do the scores predict the change? Writes OUT/fidelity.json."""

    _torchrun(nproc)

    def body():
        from .report.terminal import print_fidelity
        from .validate.fidelity import run_fidelity

        run = _resolve(config, _flags(adapter, base, train_data, eval_data, metric, pattern, negate, out_dir), set)
        cfg = run.cfg
        res = run_fidelity(cfg, loo=loo, subsets=subsets, frac=frac, preconditioners=preconditioner or None,
                           console=out)
        print_fidelity(res, out)
        out.print(f"fidelity: {cfg.output_dir / 'fidelity.json'}")
        _settings(run, "fidelity")

    _run(body, ranks=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
