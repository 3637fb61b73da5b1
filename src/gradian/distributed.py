"""Several processes, one answer: the verbs under `torchrun --nproc-per-node N -m gradian VERB CONFIG`.

Everything goes through torch.distributed (gloo on CPU, NCCL on CUDA, one device per `LOCAL_RANK`); there is no
launcher or protocol of Gradian's own. Without torchrun (no `WORLD_SIZE` in the environment) every function here
is the single-process case and costs nothing.

How work is split so that N processes give the very bits one process gives: the unit of work is a *batch* of the
single-process plan (the same rows, in the same length-sorted order), and batch j goes to rank j % N. Each batch's
arithmetic is then exactly what one process would do; results come back keyed by batch and are put together in
batch order (`gather_by_index`), and sums over chunks are added in chunk order (`ordered_sum`), never in the order
ranks happen to finish. Only rank 0 writes reports; each rank writes the index shards it captured.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group: rank, world size, local rank (the device index on its node)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def owns(self, j: int) -> bool:
        """Whether unit of work j (a batch, a retrain) is this rank's: j % world == rank."""
        return j % self.world == self.rank

    def mine(self, n: int) -> list[int]:
        return [j for j in range(n) if self.owns(j)]


def _env_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched() -> bool:
    """Started by torchrun (or srun/mpirun with the torch.distributed variables) with more than one process."""
    return _env_world() > 1


_alone = [0]  # > 0 inside `alone()`: this rank works on a unit of its own, as if it were the only process


def current() -> Ranks:
    """The group this process belongs to (single process when torch.distributed is not initialized, and inside
    `alone()`)."""
    if _alone[0]:
        return Ranks()
    return group()


def group() -> Ranks:
    """The group torch.distributed set up, even inside `alone()` (who prints, who writes)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return Ranks()
    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def init(device: str = "auto") -> Ranks:
    """Join the group torchrun started: NCCL when this process runs on CUDA (and takes the GPU of its local rank),
    gloo otherwise. A no-op without torchrun or when already initialized."""
    if not launched():
        return current()
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    return current()


@contextmanager
def alone() -> Iterator[None]:
    """Within the block this rank runs a whole unit of work by itself (one retrain of verify or fidelity, and its
    evaluation): no collectives, no split batches. Rank 0 still alone prints and writes (`group()`)."""
    _alone[0] += 1
    try:
        yield
    finally:
        _alone[0] -= 1


def finalize() -> None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    r = current()
    if r.active:
        import torch.distributed as dist

        dist.barrier()


def gather_by_index(local: dict[int, Any]) -> dict[int, Any]:
    """Every rank's {unit index: result} merged on every rank (all_gather of Python objects); single process: as
    given. Indices must be disjoint across ranks (each unit computed by its owner only)."""
    r = current()
    if not r.active:
        return dict(local)
    import torch.distributed as dist

    parts: list = [None] * r.world
    dist.all_gather_object(parts, local)
    out: dict[int, Any] = {}
    for p in parts:
        for k, v in p.items():
            if k in out:
                raise RuntimeError(f"unit {k} was computed by two ranks")
            out[k] = v
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank (single process: `obj`)."""
    r = current()
    if not r.active:
        return obj
    import torch.distributed as dist

    box = [obj if r.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def ordered_sum(partials: dict[int, Any], n: int, start: Any = 0.0):
    """The sum of partial results 0..n-1 (computed by their owners), added in index order on every rank: the bits of
    the single-process loop `acc = start; for c in range(n): acc = acc + partial[c]`."""
    every = gather_by_index(partials)
    acc = start
    for c in range(n):
        acc = acc + every[c]
    return acc


def run_owned(n: int, fn) -> dict[int, Any]:
    """{j: fn(j)} for the units this rank owns, then every unit's result on every rank."""
    r = current()
    return gather_by_index({j: fn(j) for j in range(n) if r.owns(j)})


class RowCounter:
    """Rows done across every rank, for rank 0's progress bar: an atomic counter in torch.distributed's key-value
    store (the one torchrun's rendezvous already set up). Single process: a plain count."""

    def __init__(self, key: str):
        self.key = f"gradian/{key}"
        self._local = 0
        self._store = None
        r = current()
        if r.active:
            import torch.distributed as dist

            self._store = dist.distributed_c10d._get_default_store()

    def add(self, n: int) -> int:
        """Count n more rows; returns the total done by every rank so far."""
        if self._store is None:
            self._local += n
            return self._local
        return int(self._store.add(self.key, int(n)))


def shard(items: Sequence[Any], ranks: Optional[Ranks] = None) -> list[Any]:
    """The items (units of work, in order) this rank owns."""
    r = ranks or current()
    return [x for j, x in enumerate(items) if r.owns(j)]
