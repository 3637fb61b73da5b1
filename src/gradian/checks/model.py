"""Checks of the base model: it loads, it is a causal LM, its context and vocabulary fit the data."""

from __future__ import annotations

from .estimates import text_config, vocab_rows
from .registry import Outcome, Unavailable, check, failed, passed, skipped


@check("model.context_length", "warning",
       meaning="Some tokenized rows (after truncation to grads.max_seq_length) are longer than the model's context "
               "(max_position_embeddings): out of distribution for rotary models, an indexing crash for models with "
               "learned positions (then an error).",
       fix="set grads.max_seq_length to at most the model's max_position_embeddings")
def _context_length(ctx) -> Outcome:
    c = text_config(ctx.base_config)
    limit = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
    if not isinstance(limit, int):
        return skipped("the model config gives no max_position_embeddings")
    toks, examples = ctx.toks, ctx.examples
    long = [(len(t.input_ids), e) for t, e in zip(toks, examples) if len(t.input_ids) > limit]
    if not long:
        return passed(f"the longest row has {max((len(t.input_ids) for t in toks), default=0)} tokens; the model's "
                      f"context is {limit}")
    n, e = max(long, key=lambda x: x[0])
    learned = hasattr(c, "n_positions") or getattr(c, "position_embedding_type", None) == "absolute"
    return failed(f"{len(long)} rows are longer than the model's context of {limit} tokens (max_position_embeddings) at "
                  f"grads.max_seq_length={ctx.cfg.grads.max_seq_length}; the longest has {n} tokens "
                  f"({e.source or e.id})", level="error" if learned else None)


@check("model.load_failed", "error",
       meaning="model.base cannot be loaded: no config.json, an adapter directory given as the base, broken or "
               "missing weights, an unavailable hub id.",
       fix="point model.base at a saved transformers model directory (config.json + weights) or a hub id")
def _model_load(ctx) -> Outcome:
    mcfg = ctx.base_config
    try:
        ctx.causal
    except Unavailable:
        return skipped("the base is not a causal LM; see model.not_causal_lm")
    m = ctx.base_model
    n = sum(p.numel() for p in m.parameters())
    return passed(f"{type(m).__name__} ({getattr(mcfg, 'model_type', '?')}, {n / 1e6:.2f}M parameters) on "
                  f"{next(m.parameters()).device}")


@check("model.not_causal_lm", "error",
       meaning="model.base is not a decoder-only causal LM (an encoder such as BERT, or a sequence-classification "
               "checkpoint).",
       fix="point model.base at the causal-LM checkpoint (…ForCausalLM) the adapter was trained on")
def _not_causal(ctx) -> Outcome:
    ctx.causal
    archs = getattr(ctx.base_config, "architectures", None) or []
    return passed(f"{type(ctx.base_config).__name__}" + (f" ({', '.join(archs)})" if archs else ""))


@check("tokenizer.vocab_mismatch", "error",
       meaning="The tokenizer has more tokens than the model has embedding rows: some token ids index past the "
               "embedding (a tokenizer from another model, or added tokens without resized embeddings).",
       fix="use the tokenizer saved with the model, or resize the embeddings (model.resize_token_embeddings) and "
           "save them")
def _vocab_mismatch(ctx) -> Outcome:
    tok, mcfg = ctx.tokenizer, ctx.base_config
    rows = vocab_rows(mcfg)
    m = ctx.peek("base_model")
    if m is not None:
        try:
            rows = int(m.get_input_embeddings().num_embeddings)
        except Exception:  # pragma: no cover
            pass
    if rows is None:
        return skipped("the model config has no vocab_size")
    n = len(tok)
    if n > rows:
        return failed(f"the tokenizer of model.base '{ctx.cfg.model.base}' has {n} tokens but the model's embedding has "
                      f"{rows} rows: token ids {rows}..{n - 1} would index past it")
    return passed(f"{n} tokens fit {rows} embedding rows")
