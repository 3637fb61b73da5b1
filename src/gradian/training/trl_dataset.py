"""The training set as the TRL backend hands it to `SFTTrainer`: the records in one shape with their positions
(`trl_rows`), the collator that removes rows in place (`ExcludingCollator`) and the fingerprint of what TRL
tokenized (`tokenized_fingerprint`, which a recorded run and its retrains must share)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

from ..errors import DataError

POSITION = "gradian_position"


def tokenized_fingerprint(dataset) -> str:
    """Hash of the token ids and labels of a prepared training set, row by row in dataset order."""
    h = hashlib.sha256()
    cols = dataset.column_names
    ids = dataset["input_ids"]
    labels = dataset["labels"] if "labels" in cols else [None] * len(ids)
    for a, b in zip(ids, labels):
        h.update(json.dumps([list(a), list(b) if b is not None else None]).encode())
    return h.hexdigest()[:16]


def trl_rows(examples, tokenizer, loss: str) -> tuple[list[dict], dict[str, Any]]:
    """The records as TRL reads them (one shape for the whole set), with their positions, and the SFTConfig loss
    settings that supervise what gradian's attribution does (`loss: supervised`) or every token (`all`)."""
    from ..setup.tokenize import _has_generation_tags, has_chat_template

    shapes = sorted({e.shape for e in examples})
    if len(shapes) > 1:
        raise DataError(f"data.train mixes record shapes ({', '.join(shapes)}); TRL trains one shape per dataset: "
                        "rewrite the records to one shape, or use train.backend: hf", check="data.invalid_record")
    shape = shapes[0]
    rows = [{**e.record, POSITION: e.position} for e in examples]
    if loss == "all":
        return rows, {"completion_only_loss": False, "assistant_only_loss": False}
    if shape in ("prompt_completion", "conversation_completion"):
        return rows, {"completion_only_loss": True, "assistant_only_loss": False}
    if shape == "text":
        return rows, {"completion_only_loss": None, "assistant_only_loss": False}
    if has_chat_template(tokenizer) and _has_generation_tags(tokenizer):
        return rows, {"completion_only_loss": None, "assistant_only_loss": True}
    # No {% generation %} tags: TRL cannot mask assistant turns of a conversation, but a conversation whose only
    # assistant turn is the last is the same as a prompt-completion record, whose completion TRL supervises.
    out = []
    for e, r in zip(examples, rows):
        msgs = e.record["messages"]
        if [m["role"] for m in msgs].count("assistant") != 1 or msgs[-1]["role"] != "assistant":
            raise DataError(f"{e.source or e.id}: the chat template has no {{% generation %}} tags, so TRL cannot "
                            "supervise assistant turns only of a conversation with an assistant turn before the "
                            "last; add generation tags to the template, or set train.loss: all",
                            check="data.no_chat_template")
        out.append({"prompt": msgs[:-1], "completion": msgs[-1:], POSITION: r[POSITION]})
    return out, {"completion_only_loss": True, "assistant_only_loss": False}


class ExcludingCollator:
    """Wraps the trainer's collator: strips the row positions and the raw record columns, then sets every label of
    an excluded row to -100 (its tokens leave the loss and num_items_in_batch; the batch keeps its rows)."""

    KEEP = ("input_ids", "labels", "seq_lengths", "attention_mask", "position_ids")

    def __init__(self, inner, excluded: Iterable[int]):
        self.inner, self.excluded = inner, set(int(p) for p in excluded)

    def __call__(self, features: list[dict]) -> dict:
        drop = [int(f.get(POSITION, -1)) in self.excluded for f in features]
        batch = self.inner([{k: v for k, v in f.items() if k in self.KEEP} for f in features])
        if any(drop):
            lab = batch["labels"]
            for i, d in enumerate(drop):
                if d:
                    lab[i] = -100
        return batch
