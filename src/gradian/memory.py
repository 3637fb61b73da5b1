"""Out-of-memory or a full disk anywhere becomes a `ResourceError` naming the stage and the setting to lower or the
file it could not write (exit code 2).

`memory_guard(stage)` wraps one stage of a verb: a CPU `MemoryError`, a CUDA out-of-memory error, or torch's CPU
allocator failing ("DefaultCPUAllocator: can't allocate memory", a RuntimeError) turns into one paragraph. The
traceback, with whatever the stage had allocated, is dropped with it. So does a disk that fills up (ENOSPC, EDQUOT)
while a stage writes its cache (the index, the per-row store: a later run resumes from what was checked in).
"""

from __future__ import annotations

import errno
from contextlib import contextmanager
from typing import Iterator

from .errors import ResourceError

# What to lower, per stage: the settings that bound that stage's peak.
SETTINGS = {
    "load": "model.quantization (nf4 or int8) or model.dtype: bfloat16, or a device with more memory",
    "evaluate": "evaluation.batch_size or evaluation.max_new_tokens",
    "index": "grads.batch_size or grads.max_seq_length (or grads.projection_dim, grads.projection_fit_rows)",
    "score": "grads.projection_dim (a narrower index), attribution.max_items or grads.batch_size",
    "checkpoints": "attribution.checkpoints, grads.projection_dim or grads.batch_size",
    "base_scores": "grads.batch_size or attribution.top_k",
    "spans": "grads.batch_size or grads.max_seq_length",
    "clusters": "grads.projection_dim (a narrower index)",
    "blame": "evaluation.batch_size",
    "report": "attribution.top_k",
    "dry_run": "grads.max_seq_length or grads.loss_chunk_tokens",
}


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    if type(e).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError (and torch.OutOfMemoryError)
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text
                                            or "not enough memory" in text.lower())


def out_of_memory_error(stage: str, e: BaseException) -> ResourceError:
    what = " ".join(str(e).split())[:200]
    where = "GPU" if type(e).__name__ == "OutOfMemoryError" or "CUDA" in str(e) else "host"
    return ResourceError(
        f"out of {where} memory in the {stage} stage ({type(e).__name__}: {what}); lower "
        f"{SETTINGS.get(stage, 'grads.batch_size')} and run again (finished stages are cached: a rerun resumes "
        "the index). Nothing of this stage was written.",
        fix=f"lower {SETTINGS.get(stage, 'grads.batch_size')}")


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(stage: str, e: OSError) -> ResourceError:
    where = f"writing {e.filename}" if e.filename else "writing its files"
    return ResourceError(
        f"the disk filled up in the {stage} stage ({where}: {e.strerror}); free space there, or point "
        "grads.cache_dir at a larger disk (the index and the per-row store live there; attribution.store: off keeps "
        "no per-row store), and run again: what was written and checked is reused.",
        fix="free disk space under grads.cache_dir or point it at a larger disk")


@contextmanager
def memory_guard(stage: str) -> Iterator[None]:
    try:
        yield
    except (MemoryError, RuntimeError, OSError) as e:
        if is_disk_full(e):
            err = disk_full_error(stage, e)
        elif isinstance(e, OSError) or not is_out_of_memory(e):
            raise
        else:
            err = out_of_memory_error(stage, e)
        e.__traceback__ = None  # its frames hold what the stage allocated
    else:
        return
    raise err from None
