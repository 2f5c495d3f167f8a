"""The engine's own folder inside a user's `store_dir`, locked while the engine lives.

The disk tier and the disk stash never touch anything in `store_dir` itself: they work in
`store_dir/ecru-l2l/` (`.../rank{r}/` per data-parallel rank), and only on files they name. A lock file
held with `flock` for the engine's lifetime refuses a second engine on the same folder (in this process
or another); the kernel drops the lock when its process dies, so a crashed run never blocks the next.
"""

from __future__ import annotations

import os
from pathlib import Path

from ecru.errors import EcruError
from ecru.io import FolderLock
from ecru.l2l.config import L2LInputError

NAME = "ecru-l2l"


class Workspace:
    """`store_dir/ecru-l2l[/rank{r}]`, created if missing and locked until `close()`."""

    def __init__(self, store_dir: str | os.PathLike, *, rank: int | None = None):
        root = Path(store_dir).expanduser() / NAME
        self.path = root / f"rank{rank}" if rank is not None else root
        self._lock = FolderLock(self.path, what="store_dir for this engine")
        try:
            self._lock.acquire()
        except OSError as exc:
            raise L2LInputError(
                f"cannot use store_dir {store_dir} ({exc.strerror}); give a writable folder"
            ) from None
        except EcruError as exc:
            raise L2LInputError(str(exc)) from None

    def folder(self, name: str) -> Path:
        """A subfolder of the workspace (created if missing)."""
        path = self.path / name
        path.mkdir(exist_ok=True)
        return path

    def close(self) -> None:
        """Release the lock (the lock file stays: it is the workspace's, and harmless)."""
        self._lock.release()
