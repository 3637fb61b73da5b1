"""Estimates before anything costly runs: the peak of the loss's fp32 logits, the size of the index on disk."""

from __future__ import annotations

import shutil

from ..errors import GradianError
from .estimates import dtype_bytes, free_memory, human, param_estimate, vocab_rows
from .registry import Outcome, Unavailable, check, failed, passed, skipped


@check("memory.logit_upcast", "warning",
       meaning="Estimate of the fp32 logits peak of the loss: the chunked loss needs loss_chunk_tokens x vocab x 4 "
               "bytes at a time (versus batch x seq x vocab x 4 for a naive upcast), on top of the weights, compared "
               "with the device's free memory.",
       fix="lower grads.loss_chunk_tokens or grads.batch_size, use model.dtype bfloat16, or a device with more memory")
def _logit_upcast(ctx) -> Outcome:
    mcfg = ctx.base_config
    V = vocab_rows(mcfg)
    if V is None:
        return skipped("the model config has no vocab_size")
    g = ctx.cfg.grads
    device = ctx.device
    tokens = g.batch_size * g.max_seq_length
    chunk = min(g.loss_chunk_tokens, tokens)
    chunked, naive = chunk * V * 4, tokens * V * 4
    try:  # weights already resident are in the free-memory figure; otherwise add their estimate
        ctx.base_model
        pending = 0
    except Unavailable:
        params = param_estimate(mcfg)
        pending = params * dtype_bytes(ctx.cfg, mcfg) if params else 0
    free, where = free_memory(device)
    msg = (f"fp32 logits peak ~{human(chunked)} per chunk of {chunk} tokens (grads.loss_chunk_tokens) x vocab {V}; a "
           f"naive upcast of batch {g.batch_size} x seq {g.max_seq_length} would need {human(naive)}")
    if free is None:
        return passed(msg + f"; free memory on {where} unknown")
    need = chunked + pending
    msg += f"; {human(free)} {where}" + (f", weights still to load ~{human(pending)}" if pending else "")
    if need > free:
        return failed(msg + ": the loss would not fit")
    return passed(msg)


@check("index.size", "warning",
       meaning="Estimate of the gradient index on disk: rows x dim x bytes of grads.storage_dtype (+4 bytes per row "
               "for the norm of half-precision rows), dim from the LoRA sites and grads.projection_dim; a warning when "
               "it exceeds the free disk at the index directory.",
       fix="set grads.projection_dim (e.g. 8192) and/or grads.storage_dtype: bfloat16, or point grads.cache_dir at a "
           "bigger disk")
def _index_size(ctx) -> Outcome:
    from ..grads.layout import exact_widths, site_shapes
    from ..projection import Projector, choose_projection

    sites, _ = ctx.sites
    examples = ctx.examples
    g = ctx.cfg.grads
    choice = choose_projection(g.projection_dim, sum(exact_widths(sites)), len(examples), g.storage_dtype)
    try:
        dim = Projector(site_shapes(sites), choice.dim, g.projection_kind, g.projection_seed).dim
    except (GradianError, ValueError) as e:  # e.g. a projection_dim below what these sites need
        return failed(str(e), "set grads.projection_dim to a width these LoRA sites allow, or auto",
                      level="error")
    half = g.storage_dtype in ("float16", "bfloat16")
    per_row = dim * (2 if half else 4) + (4 if half else 0)
    total = len(examples) * per_row
    where = ctx.cfg.index_dir
    anchor = next((q for q in [where, *where.parents] if q.exists()), None)
    free = shutil.disk_usage(anchor).free if anchor is not None and anchor.is_dir() else None
    msg = (f"{len(examples)} rows x dim {dim} ({len(sites)} sites, "
           f"{'projection_dim ' + str(choice.dim) if choice.dim else 'exact, no projection'}; {choice.reason}) x "
           f"{g.storage_dtype} = {human(total)} at {where}")
    if free is None:
        return passed(msg)
    msg += f"; {human(free)} free there"
    if total > free:
        return failed(msg + ": the index would not fit (rows already cached there are not counted)")
    return passed(msg)
