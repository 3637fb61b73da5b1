"""Checks of the data files and records, and of their rendering by the tokenizer."""

from __future__ import annotations

from typing import Any

from .registry import Outcome, Unavailable, check, failed, passed, skipped


@check("data.unreadable_record", "error",
       meaning="A data file cannot be read as records: invalid JSON, non-UTF-8 bytes, an over-long line, an "
               "unsupported file type or a directory that is not a save_to_disk dataset. The message names file:line.",
       fix="repair the record at the named file:line (one JSON object per line, UTF-8)")
def _data_unreadable(ctx) -> Outcome:
    problems, notes, missing = [], [], []
    for key, rows, u in both_files(ctx):
        if u is not None:
            (problems if u.owner == "data.unreadable_record" else missing).append(
                u.message if u.owner == "data.unreadable_record" else f"{key} ({u.owner})")
        elif rows is not None:
            notes.append(f"{key}: {len(rows)} records")
    if problems:
        return failed("; ".join(problems))
    if missing and not notes:
        return skipped(f"{', '.join(missing)} did not load")
    return passed(", ".join(notes))


def both_files(ctx):
    """(key, rows or None, Unavailable or None) for data.train and data.eval."""
    for key, get in (("data.train", lambda: ctx.train_rows), ("data.eval", lambda: ctx.eval_rows)):
        try:
            yield key, get(), None
        except Unavailable as u:
            yield key, None, u


@check("data.empty", "error",
       meaning="The training (or eval) file holds no records.",
       fix="point data.train / data.eval at a file with records")
def _data_empty(ctx) -> Outcome:
    msgs, ok, missing = [], [], []
    for key, rows, u in both_files(ctx):
        if u is not None:
            missing.append(f"{key} ({u.owner})")
        elif rows is not None and not rows:
            msgs.append(f"{ctx.train_path if key == 'data.train' else ctx.eval_path}: no records ({key} is empty)")
        elif rows is not None:
            ok.append(f"{key}: {len(rows)}")
    if msgs:
        return failed("; ".join(msgs))
    if missing and not ok:
        return skipped(f"{', '.join(missing)} did not load")
    return passed("records: " + ", ".join(ok))


@check("data.unknown_record_shape", "error",
       meaning="A record matches none of the known shapes: train {messages}, {prompt, completion} or {text}; eval "
               "{prompt, answer} or {messages, answer}.",
       fix="rename the fields to one of the supported shapes (docs/config.md: data.train, data.eval)")
def _data_unknown_shape(ctx) -> Outcome:
    return _record_problems(ctx, "data.unknown_record_shape", 1, "record(s) with an unknown shape",
                            "every record has a known shape")


@check("data.invalid_record", "error",
       meaning="A record has a known shape but a bad field: a non-string content, an unknown role, a conversation "
               "without an assistant turn, an eval conversation that ends with the answer.",
       fix="repair the field named at file:line, or drop the record")
def _data_invalid(ctx) -> Outcome:
    return _record_problems(ctx, "data.invalid_record", 2, "malformed record(s)", "every record is well formed")


def _record_problems(ctx, check_id: str, which: int, what: str, ok: str) -> Outcome:
    """The training records' (train_parse[which]) and the eval file's problems of one kind, the first three named."""
    msgs = list(ctx.train_parse[which])
    if ctx.eval_rows:
        _, problem = ctx.eval_parse
        if problem and problem[0] == check_id:
            msgs.append(problem[1])
    if msgs:
        more = f" (and {len(msgs) - 3} more)" if len(msgs) > 3 else ""
        return failed(f"{len(msgs)} {what}: " + "; ".join(msgs[:3]) + more)
    return passed(ok)


@check("data.duplicate_rows", "warning",
       meaning="Some training records are exact copies of earlier ones: copies share one gradient, rank together, "
               "and a removal test must drop every copy.",
       fix="deduplicate data.train, or read copies of a row as one row (drop all of them in verify)")
def _data_duplicates(ctx) -> Outcome:
    first: dict[str, Any] = {}
    dups = []
    for e in ctx.examples:
        h = e.id.rsplit("-", 1)[-1]
        if h in first:
            dups.append((e, first[h]))
        else:
            first[h] = e
    if dups:
        ex = ", ".join(f"{e.source or e.position} repeats {o.source or o.position}" for e, o in dups[:3])
        return failed(f"{len(dups)} of {len(ctx.examples)} training rows repeat an earlier row exactly ({ex})")
    return passed(f"{len(ctx.examples)} distinct training rows")


@check("tokenizer.load_failed", "error",
       meaning="No tokenizer loads from model.base.",
       fix="save the tokenizer next to the model (tokenizer.save_pretrained(model.base))")
def _tokenizer_load(ctx) -> Outcome:
    tok = ctx.tokenizer
    return passed(f"{type(tok).__name__} with {len(tok)} tokens from model.base '{ctx.cfg.model.base}'")


@check("data.no_chat_template", "warning",
       meaning="The tokenizer has no chat template: conversations are rendered as 'role: content' lines and whole "
               "sequences are supervised. Info for text-only data, a warning otherwise.",
       fix="use the tokenizer the model was fine-tuned with, with a chat template (ideally with {% generation %} tags)")
def _no_chat_template(ctx) -> Outcome:
    from ..setup.tokenize import has_chat_template

    tok = ctx.tokenizer
    if has_chat_template(tok):
        return passed(f"the tokenizer of '{ctx.cfg.model.base}' has a chat template")
    try:
        examples = ctx.examples
        text_only = bool(examples) and all(e.shape == "text" for e in examples)
    except Unavailable:
        text_only = False
    return failed(f"the tokenizer of model.base '{ctx.cfg.model.base}' has no chat_template"
                  + (": fine for text records" if text_only else
                     ": chats are rendered as 'role: content' lines and every token is supervised"),
                  level="info" if text_only else "warning")


@check("data.tokenize_failed", "error",
       meaning="A record cannot be rendered by the chat template (a role the template rejects, a template that is "
               "not prefix-stable) or tokenized.",
       fix="drop or rewrite the record, or use a chat template that accepts it")
def _tokenize_failed(ctx) -> Outcome:
    toks = ctx.toks
    return passed(f"{len(toks)} rows tokenized (grads.max_seq_length {ctx.cfg.grads.max_seq_length})")


@check("data.no_supervised_tokens", "warning",
       meaning="Rows whose supervised tokens (the completion or assistant turns) vanish after truncation to "
               "grads.max_seq_length: their gradient is zero and they can never be accused. An error when every row "
               "is affected.",
       fix="raise grads.max_seq_length, or shorten the prompts of those rows")
def _no_supervised(ctx) -> Outcome:
    toks, examples = ctx.toks, ctx.examples
    empty = [e for e, t in zip(examples, toks) if t.n_supervised == 0]
    L = ctx.cfg.grads.max_seq_length
    if empty:
        first = ", ".join(f"{e.id} ({e.source})" if e.source else e.id for e in empty[:3])
        return failed(f"{len(empty)} of {len(examples)} training rows have no supervised tokens after truncation to "
                      f"grads.max_seq_length={L} (first: {first})", level="error" if len(empty) == len(examples) else None)
    n_trunc = sum(t.truncated for t in toks)
    return passed(f"every row keeps supervised tokens at grads.max_seq_length={L}"
                  + (f" ({n_trunc} rows truncated)" if n_trunc else ""))
