"""Writes a set of files all-or-nothing: temp file beside each target, fsync, os.replace.

A rename is atomic per file, never across files, so on any failure every file already
replaced is put back from the bytes read before writing (or removed, if it was new).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .errors import ReadOnlyTarget, WriteFailed


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Change:
    """`new` None means delete. `mode` applies to files we create; existing files keep theirs."""

    path: Path
    new: Optional[bytes]
    mode: int = 0o644


def check_writable(path: Path, shown: str) -> None:
    """Refuse files the user made read-only, even when we run as root and could replace them."""
    if path.exists():
        mode = path.stat().st_mode
        if not mode & stat.S_IWUSR or not os.access(path, os.W_OK):
            raise ReadOnlyTarget(
                f"{shown} is read-only (mode {stat.S_IMODE(mode):04o})",
                f"make it writable (`chmod u+w {shown}`) if it may be patched, then run again",
            )
    parent = path.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ReadOnlyTarget(
            f"{shown}: its directory is not writable", "fix the directory's permissions"
        )


def _replace_file(tmp: str, target: Path) -> None:
    """The one rename; a seam the tests use to fail a write half-way."""
    os.replace(tmp, target)


def _write_one(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ttp-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        _replace_file(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _apply(change: Change) -> None:
    if change.new is None:
        if change.path.exists():
            change.path.unlink()
            _fsync_dir(change.path.parent)
        return
    mode = stat.S_IMODE(change.path.stat().st_mode) if change.path.exists() else change.mode
    _write_one(change.path, change.new, mode)


def write_all(changes: Sequence[Change]) -> None:
    """Apply every change or none; raise WriteFailed after rolling back."""
    originals: List[Tuple[Change, Optional[bytes], int]] = []
    for ch in changes:
        if ch.path.exists():
            originals.append((ch, ch.path.read_bytes(), stat.S_IMODE(ch.path.stat().st_mode)))
        else:
            originals.append((ch, None, ch.mode))
    done: List[Tuple[Change, Optional[bytes], int]] = []
    try:
        for entry in originals:
            _apply(entry[0])
            done.append(entry)
    except Exception as exc:
        failed = entry[0].path
        problems = []
        for ch, old, mode in reversed(done):
            try:
                _apply(Change(ch.path, old, mode))
            except Exception as undo_exc:  # pragma: no cover - disk gone bad during rollback
                problems.append(f"{ch.path}: {undo_exc}")
        msg = (
            f"writing {failed} failed ({exc}); the {len(done)} file(s) written before were restored"
        )
        if problems:  # pragma: no cover
            msg += "; could NOT restore: " + "; ".join(problems)
        raise WriteFailed(msg, "fix the cause (disk full? permissions?) and run again") from exc
