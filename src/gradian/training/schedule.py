"""Learning-rate schedules: the rate of every optimizer step, through transformers' own schedulers.

`gradian train`, the TRL backend and the callback all step `transformers.get_scheduler` schedules, so the rate of
step s (1-based) is what that scheduler gives before its s-th `step()`. `step_rates` recomputes the list from the
recipe (name, base rate, warm-up, total steps) without training, which is what checkpoint weighting needs when no
per-step record was kept.
"""

from __future__ import annotations

SCHEDULES = ("constant", "linear", "cosine")


def make_scheduler(optimizer, name: str, *, warmup_steps: int, total_steps: int):
    """transformers' scheduler `name` over `total_steps` optimizer steps; `constant` with a warm-up is
    `constant_with_warmup` (plain `constant` ignores warm-up there)."""
    from transformers import get_scheduler

    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    kind = "constant_with_warmup" if name == "constant" and warmup_steps > 0 else name
    return get_scheduler(kind, optimizer, num_warmup_steps=int(warmup_steps), num_training_steps=int(total_steps))


def step_rates(name: str, learning_rate: float, *, warmup_steps: int, total_steps: int) -> list[float]:
    """The learning rate of each of the `total_steps` optimizer steps (index s-1 for step s)."""
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=float(learning_rate))
    sched = make_scheduler(opt, name, warmup_steps=warmup_steps, total_steps=total_steps)
    out = []
    for _ in range(int(total_steps)):
        out.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return out
