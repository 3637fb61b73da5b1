"""How many padded tokens one per-example backward may hold: the bound that keeps a pass's memory flat when rows are
long.

A batched backward with the LoRA hooks holds, per padded token, each adapted site's input and output gradient (what
the per-example gradients are formed from, `grads.capture`) and the activations autograd saved to reach the lower
layers. So its memory grows with rows x the batch's longest row, not with the rows alone: on SmolLM2-135M with a
rank-8 LoRA on every projection, eight conversations of 221 tokens took 6.3 GB (eight short chat rows of about 60
tokens, 1.6 GB), measured as the process's peak RSS over one batch. `backward_bytes_per_token` estimates that cost
from the model's shape, and `max_batch_tokens` turns `BACKWARD_BYTES` into a token bound that
`setup.batches.token_parts` applies: a batch of long rows is cut into smaller ones, and a batch of short rows is
the same as before (the bound is above every batch of the built-in models and of the real scenarios' fact and
behaviour rows: their scores are unchanged).
"""

from __future__ import annotations

from typing import Optional, Sequence

# what one backward's per-token state may take: with the model and a pass's other arrays (about 1.8 GB at 2,000
# rows, measured) this keeps a pass under 4 GiB
BACKWARD_BYTES = 2 * 1024**3
# floats saved per token and layer besides the sites' own, in units of the hidden and intermediate widths (fitted on
# SmolLM2-135M: 3.0 MB a token estimated, 3.7 MB measured at 221 tokens, the rest the attention's T x heads)
HIDDEN_FLOATS, INTERMEDIATE_FLOATS = 10, 6


def _config_value(model, names: Sequence[str]) -> Optional[int]:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg  # a multimodal config keeps the language model's apart
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def backward_bytes_per_token(model, sites) -> int:
    """Bytes one padded token costs a per-example backward: each LoRA site's input and output gradient, and the
    activations each layer saves (from the model config's hidden and intermediate widths and layer count; without
    them, the sites alone)."""
    site_floats = sum(s.A.in_features + s.B.out_features for s in sites)
    layers = _config_value(model, ("num_hidden_layers", "n_layer", "num_layers")) or 0
    hidden = _config_value(model, ("hidden_size", "n_embd", "d_model")) or 0
    inter = _config_value(model, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * hidden
    return 4 * (site_floats + layers * (HIDDEN_FLOATS * hidden + INTERMEDIATE_FLOATS * inter))


def max_batch_tokens(model, sites, budget: Optional[int] = None) -> int:
    """The padded tokens (rows x longest row) one backward may hold within `budget` bytes (`BACKWARD_BYTES`, read at
    call time) (at least 1: a row longer than that is a batch of its own)."""
    budget = BACKWARD_BYTES if budget is None else budget
    return max(1, int(budget // max(backward_bytes_per_token(model, sites), 1)))
