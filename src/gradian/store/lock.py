"""The index lock: one process builds an index at a time (`flock`, dropped by the kernel when its holder dies)."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..errors import IndexError_

LOCK_FILE = ".lock"


class IndexLocked(IndexError_):
    """Another process kept the index open for longer than the lock timeout."""

    def __init__(self, message: str, *, lock_path: Path, holder_pid: Optional[int]):
        super().__init__(message)
        self.lock_path = Path(lock_path)
        self.holder_pid = holder_pid


class Lock:
    """Exclusive `flock` on root/.lock. The kernel drops it when the holder dies, so a killed build never leaves
    a stale lock behind; the pid inside the file is only there to name the holder in the timeout message.
    `shared`: a reader's lock (the ranks of a torchrun job scoring one index at once); it waits for a writer, and
    a writer waits for every reader."""

    def __init__(self, path: Path, timeout: float, shared: bool = False):
        self.path = path
        self.shared = shared
        self._fd: Optional[int] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + max(0.0, timeout)
        delay = 0.01
        while True:
            try:
                fcntl.flock(self._fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(self._fd)
                    self._fd = None
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holder = self._holder()
                os.close(self._fd)
                self._fd = None
                who = f"pid {holder[0]} on {holder[1]}" if holder else "a process whose pid was not recorded"
                raise IndexLocked(
                    f"gradient index lock {path} is held by {who}; gave up after waiting {timeout:g} s. Another "
                    "build of this index is running: wait for it to finish, or point this run at another "
                    "index directory.",
                    lock_path=path,
                    holder_pid=holder[0] if holder else None,
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)
        if not shared:  # readers leave the writer's record alone
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

    def _holder(self) -> Optional[tuple[int, str]]:
        try:
            parts = self.path.read_text().split()
            return int(parts[0]), (parts[1] if len(parts) > 1 else "?")
        except (OSError, ValueError, IndexError):
            return None

    def __del__(self) -> None:
        # An index dropped without close() must not hold the lock for the rest of the process.
        try:
            self.release()
        except Exception:
            pass

    def release(self) -> None:
        if getattr(self, "_fd", None) is None:
            return
        try:
            if not self.shared:
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None
