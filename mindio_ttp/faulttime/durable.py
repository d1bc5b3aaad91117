"""Durability of directory updates, shared by the fault claim and the checkpoint writer."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the creates, renames and unlinks inside `path` durable (they update the
    directory, which a file's own fsync does not cover)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
