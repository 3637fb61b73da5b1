"""Padded batches of tokenized rows: the one batch loop every stage uses (capture, losses, generation prompts)."""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

from .tokenize import Tokenized


def collate(batch: Sequence[Tokenized], pad_id: int, *, left: bool = False):
    """Pad to the longest row. Right padding for loss/gradients; left padding for generation."""
    import torch

    T = max(len(t.input_ids) for t in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    sup = torch.zeros((len(batch), T), dtype=torch.bool)
    for i, t in enumerate(batch):
        n = len(t.input_ids)
        sl = slice(T - n, T) if left else slice(0, n)
        ids[i, sl] = torch.tensor(t.input_ids, dtype=torch.long)
        attn[i, sl] = 1
        sup[i, sl] = torch.tensor(t.supervised, dtype=torch.bool)
    return ids, attn, sup


def length_order(toks: Sequence[Tokenized], positions: Optional[Sequence[int]] = None) -> list[int]:
    """Positions by (length, position): batches of similar lengths pad less, and a fixed order keeps the batches,
    and so the bits, the same on every run."""
    pos = list(range(len(toks))) if positions is None else list(positions)
    return sorted(pos, key=lambda i: (len(toks[i].input_ids), i))


def batches(toks: Sequence[Tokenized], positions: Sequence[int], batch_size: int, pad_id: int, device=None
            ) -> Iterator[tuple[list[int], "object", "object", "object"]]:
    """(positions, input_ids, attention_mask, supervised) per batch of `batch_size` of `positions` in the order
    given, right-padded (`collate`) and moved to `device` when given."""
    for _, part, ids, attn, sup in owned_batches(toks, positions, batch_size, pad_id, device):
        yield part, ids, attn, sup


def token_parts(toks: Sequence[Tokenized], positions: Sequence[int], batch_size: int,
                max_tokens: Optional[int] = None) -> list[list[int]]:
    """`positions` in the order given, cut into batches of at most `batch_size` rows and, with `max_tokens`, at most
    that many padded tokens (rows x the batch's longest row; a row longer than that is a batch of its own). Why a
    token bound: a backward's memory grows with the padded tokens it holds, so eight long conversations take several
    times the memory of eight short rows (`gradian.grads.budget`). Without it, or where no batch
    reaches it, the batches are those of `batch_size` alone."""
    pos = list(positions)
    if not max_tokens:
        return [pos[s : s + batch_size] for s in range(0, len(pos), batch_size)]
    out, part, longest = [], [], 0
    for p in pos:
        n = len(toks[p].input_ids)
        if part and (len(part) >= batch_size or (len(part) + 1) * max(longest, n) > max_tokens):
            out.append(part)
            part, longest = [], 0
        part.append(p)
        longest = max(longest, n)
    if part:
        out.append(part)
    return out


def owned_batches(toks: Sequence[Tokenized], positions: Sequence[int], batch_size: int, pad_id: int, device=None,
                  owned: Optional[Callable[[int], bool]] = None, max_tokens: Optional[int] = None):
    """(j, positions, input_ids, attention_mask, supervised) for the batches j of `token_parts` that `owned(j)`
    keeps (under torchrun: this rank's, `distributed.Ranks.owns`); the others are not even padded."""
    for j, part in enumerate(token_parts(toks, positions, batch_size, max_tokens)):
        if owned is not None and not owned(j):
            continue
        ids, attn, sup = collate([toks[i] for i in part], pad_id)
        if device is not None:
            ids, attn, sup = ids.to(device), attn.to(device), sup.to(device)
        yield j, part, ids, attn, sup
