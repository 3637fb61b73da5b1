"""Checks of the configuration and the runtime: paths, device, threads."""

from __future__ import annotations

import os

from ..errors import ConfigError
from .estimates import blocking_file, cpu_count
from .registry import Outcome, check, failed, passed


@check("config.paths", "error",
       meaning="A path in the config (data.train, data.eval, model.base, model.adapter, "
               "attribution.checkpoint_adapters, output, grads.cache_dir, train.output) is missing, or an output "
               "location is blocked by a file.",
       fix="fix the path in the config; relative paths resolve against the config file's directory")
def _config_paths(ctx) -> Outcome:
    cfg = ctx.cfg
    problems = []
    from ..errors import DataError
    from ..setup.records import HubDataset, data_location, location_fingerprint

    for key, value in (("data.train", cfg.data.train), ("data.eval", cfg.data.eval)):
        loc = data_location(cfg, value)
        if isinstance(loc, HubDataset):
            try:
                location_fingerprint(loc)
            except DataError as e:
                problems.append(f"{key}: {e}")
        elif value and not loc.exists():
            problems.append(f"{key}: {loc} not found")
    for key, value in (("model.base", cfg.model.base), ("model.adapter", cfg.model.adapter)):
        try:
            cfg.local_or_hub(value, key)
        except ConfigError as e:
            problems.append(str(e))
    for i, a in enumerate(cfg.attribution.checkpoint_adapters):
        p = cfg.path(a)
        if p is None or not (p / "adapter_config.json").exists():
            problems.append(f"attribution.checkpoint_adapters[{i}]: {p} is not an adapter directory (no "
                            "adapter_config.json)")
    for key, p in (("output", cfg.output_dir), ("grads.cache_dir", cfg.index_dir), ("train.output", cfg.adapter_out)):
        blocker = blocking_file(p)
        if blocker is not None:
            problems.append(f"{key}: {blocker} is a file, so the directory {p} cannot be created")
    if problems:
        return failed("; ".join(problems))
    where = f" (relative to {cfg.root})" if cfg.root else ""
    return passed(f"data, model and output paths resolve{where}")


@check("device.unavailable", "error",
       meaning="model.device names a device this machine does not have (cuda without CUDA, mps without MPS).",
       fix="set model.device: auto (CUDA when present, else CPU) or cpu")
def _device_unavailable(ctx) -> Outcome:
    d = ctx.device
    return passed(f"model.device '{ctx.cfg.model.device}' resolves to {d}")


@check("device.mps_not_auto", "info",
       meaning="An Apple GPU (MPS) is present but model.device is auto, which picks CPU: MPS kernels are not "
               "deterministic enough to be a default.",
       fix="set model.device: mps to use the Apple GPU (runs are then not bit-reproducible)")
def _device_mps(ctx) -> Outcome:
    import torch

    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if ctx.cfg.model.device == "auto" and mps and not torch.cuda.is_available():
        return failed("model.device is 'auto' and this machine has MPS: gradian runs on the CPU unless model.device "
                      "is 'mps'")
    return passed(f"model.device '{ctx.cfg.model.device}'" + (" (MPS present)" if mps else ""))


@check("runtime.threads", "warning",
       meaning="More torch CPU threads than the cores can serve: on 1-2 (shared) cores OpenMP spin-waits make each "
               "step many times slower.",
       fix="set model.threads: 1 (or GRADIAN_THREADS=1); use more threads only with as many free cores")
def _runtime_threads(ctx) -> Outcome:
    env = os.environ.get("GRADIAN_THREADS")
    if ctx.cfg.model.threads:
        n, src = ctx.cfg.model.threads, "model.threads"
    elif env:
        try:
            n, src = int(env), "GRADIAN_THREADS"
        except ValueError:
            return failed(f"GRADIAN_THREADS={env!r} is not an integer", "unset GRADIAN_THREADS or set it to a number",
                          level="error")
        if n < 1:
            return failed(f"GRADIAN_THREADS={env!r} must be at least 1", "unset GRADIAN_THREADS or set it to 1",
                          level="error")
    else:
        n, src = 1, "default"
    cores = cpu_count()
    if (n > 1 and cores <= 2) or n > cores:
        return failed(f"{src} = {n} torch threads on {cores} CPU core(s)")
    return passed(f"{n} torch thread(s) ({src}) on {cores} CPU core(s)")
