"""Learning-rate schedules: the rate of every optimizer step, through transformers' own schedulers.

`gradian train`, the TRL backend and the callback all step `transformers.get_scheduler` schedules, so the rate of
step s (1-based) is what that scheduler gives before its s-th `step()`. `step_rates` recomputes the list from the
recipe (name, base rate, warm-up, total steps) without training, which is what checkpoint weighting needs when no
per-step record was kept.
"""

from __future__ import annotations

from typing import Sequence

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


def interval_means(rates: Sequence[float], steps: Sequence[int]) -> list[float]:
    """Mean learning rate of the steps each checkpoint stands for: checkpoint i, saved after step `steps[i]`
    (ascending), covers steps (steps[i-1], steps[i]] (the first from step 1). With a constant rate every mean is that
    rate, whatever the spacing."""
    out, prev = [], 0
    for t in steps:
        t = int(t)
        seg = list(rates[prev:t]) if t > prev else []
        if not seg:  # a checkpoint past the recorded steps, or two at one step: the nearest recorded rate
            seg = [rates[min(max(t, 1), len(rates)) - 1]] if len(rates) else []
        if not seg:
            out.append(float("nan"))
        else:  # an exactly constant stretch keeps its rate bit for bit (sum / n can round it)
            out.append(float(seg[0]) if all(x == seg[0] for x in seg) else float(sum(seg) / len(seg)))
        prev = max(prev, t)
    return out
