"""One ttp-patch at a time per checkout: an flock on .git/ttp-patch.lock held for a whole command.

Preflight and write must see the same tree, so the lock covers both; without it two applies with
different devices both pass preflight and interleave their writes. The file is never deleted
(unlinking a locked file lets a third process lock a fresh inode), and the kernel drops the lock
when the holder dies, SIGKILL included, so a stale lock cannot exist.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path
from typing import Optional

from .errors import Busy

LOCK_NAME = "ttp-patch.lock"
WAIT_S = 2.0  # long enough for a status beside a finishing apply, short enough to fail fast
_POLL_S = 0.05


class Lock:
    """Held from `acquire` to `release`; not `held` when .git is read-only (nothing to guard)."""

    def __init__(self, git_dir: Path) -> None:
        self.path = git_dir / LOCK_NAME
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait_s: float = WAIT_S) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return  # a read-only checkout: nobody can write it, so nothing can race
            raise Busy(
                f"cannot open {self.path}: {exc.strerror}", "check .git's permissions"
            ) from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise Busy(
                        f"another ttp-patch{holder} is working on this checkout",
                        "wait for it to finish, then run again",
                    ) from None
                time.sleep(_POLL_S)
        self._fd = fd
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock


def _read_holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
        return f" (pid {pid})"
    return ""
