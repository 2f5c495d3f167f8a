"""The engine's own folder inside a user's `store_dir`, locked while the engine lives.

The disk tier and the disk stash never touch anything in `store_dir` itself: they work in
`store_dir/ecru-l2l/` (`.../rank{r}/` per data-parallel rank), and only on files they name. A lock file
held with `flock` for the engine's lifetime refuses a second engine on the same folder (in this process
or another); the kernel drops the lock when its process dies, so a crashed run never blocks the next.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ecru.l2l.config import L2LInputError

NAME = "ecru-l2l"
LOCK = "lock"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder `path` (a rename, a new or deleted file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Workspace:
    """`store_dir/ecru-l2l[/rank{r}]`, created if missing and locked until `close()`."""

    def __init__(self, store_dir: str | os.PathLike, *, rank: int | None = None):
        root = Path(store_dir).expanduser() / NAME
        self.path = root / f"rank{rank}" if rank is not None else root
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.path / LOCK, "a+")  # noqa: SIM115 - held open until close()
        except OSError as exc:
            raise L2LInputError(
                f"cannot use store_dir {store_dir} ({exc.strerror}); give a writable folder"
            ) from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "unknown"
            self._lock.close()
            raise L2LInputError(
                f"{self.path} is in use by another L2L engine (process {holder}); close that engine or "
                "give this one another store_dir"
            ) from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"{os.getpid()}\n")
        self._lock.flush()

    def folder(self, name: str) -> Path:
        """A subfolder of the workspace (created if missing)."""
        path = self.path / name
        path.mkdir(exist_ok=True)
        return path

    def close(self) -> None:
        """Release the lock (the lock file stays: it is the workspace's, and harmless)."""
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
