"""The optimizer state saved beside an adapter, laid out as the HF Trainer and TRL save theirs.

`gradian train` writes `OPTIMIZER_FILE` (`optimizer.pt`, transformers' `trainer.OPTIMIZER_NAME`) into the adapter
folder and into each checkpoint it saves on the way: `torch.save(optimizer.state_dict())`, AdamW's `step`,
`exp_avg` and `exp_avg_sq` per parameter index, the indices in the order of the model's trainable parameters
(`named_parameters`). A Trainer's `checkpoint-*/optimizer.pt` has the same layout: it builds its AdamW from
`named_parameters` too, and every LoRA weight lands in its weight-decay group (no bias, no norm in the names).
One addition, torch's own key for an optimizer built from named parameters: each param group's `param_names`, so
the file says which tensor is which without the model (and `second_moments` checks it when present).

`second_moments` reads such a file, gradian's or a Trainer's, back onto the LoRA sites of a loaded adapter: Adam's
second moment per (site, "A" | "B"), what a diagonal preconditioner taken from the optimizer reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

OPTIMIZER_FILE = "optimizer.pt"


def save_optimizer_state(optimizer, model, folder: Path | str) -> Path:
    """`optimizer`'s state_dict as `folder/OPTIMIZER_FILE`, each param group naming its parameters (`model`'s
    names). Writes into `folder` as it is: the caller's `atomic_dir` makes the adapter folder appear whole."""
    names = {id(p): n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    for packed, live in zip(sd["param_groups"], optimizer.param_groups):
        packed.setdefault("param_names", [names.get(id(p), "") for p in live["params"]])
    path = Path(folder) / OPTIMIZER_FILE
    torch.save(sd, path)
    return path


def second_moments(folder: Path | str, model, adapter_name: Optional[str] = None
                   ) -> Optional[dict[tuple[str, str], torch.Tensor]]:
    """AdamW's `exp_avg_sq` per LoRA weight of adapter `adapter_name` (default: the active one), keyed (site name,
    "A" | "B") as `setup.model.lora_sites` names the sites, from `folder/OPTIMIZER_FILE`; None when the folder has
    no such file. A weight the optimizer never stepped has zeros. Raises ValueError naming the file when its state
    does not map onto the adapter's LoRA weights (another adapter, or more parameters trained than LoRA's)."""
    from ..setup.model import lora_sites

    path = Path(folder) / OPTIMIZER_FILE
    if not path.is_file():
        return None
    sd = torch.load(path, map_location="cpu", weights_only=True)
    sites, _ = lora_sites(model, None, adapter_name)
    keys = {id(w): (s.name, side, w) for s in sites for side, w in (("A", s.A.weight), ("B", s.B.weight))}
    # the order the optimizer was built in: the trainable parameters as the model lists them
    order = [keys[id(p)] for _, p in model.named_parameters() if id(p) in keys]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    names = [n for g in sd["param_groups"] for n in g.get("param_names", [])]
    if len(ids) != len(order):
        raise ValueError(f"{path}: the optimizer holds {len(ids)} parameters, the adapter has {len(order)} LoRA "
                         "weights; it was saved for another adapter or trained more than the LoRA weights")
    out = {}
    for k, (i, (site, side, w)) in enumerate(zip(ids, order)):
        if names and f".{site}.lora_{side}." not in f".{names[k]}":
            raise ValueError(f"{path}: parameter {i} is {names[k]}, expected {site}'s lora_{side}")
        st = sd["state"].get(i)
        v = st["exp_avg_sq"] if st is not None else torch.zeros(w.shape)
        if tuple(v.shape) != tuple(w.shape):
            raise ValueError(f"{path}: parameter {i} has shape {tuple(v.shape)}, {site}'s lora_{side} "
                             f"{tuple(w.shape)}")
        out[(site, side)] = v
    return out
