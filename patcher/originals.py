"""The user's own bytes of each target before apply, so revert gives back theirs, not 285068c's.

The record keeps only their sha256 (`FileRecord.before`). The bytes come from, in order: a copy
apply stored in the git directory (written only when they were not HEAD's, i.e. a file edited
and not committed, patched under --allow-modified), the blob at the commit the record names
(covers a commit made after apply), and HEAD's blob. A candidate is used only when its sha256 is
the recorded one, so a stale or planted copy can never be restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from . import fileio
from .edits import TARGET_FILES
from .manifest import Manifest
from .repo import Checkout

PREFIX = "ttp-patch.orig."
MAX_BYTES = 16 << 20  # far above any Megatron source file; bounds what a planted file costs


def stored_path(git_dir: Path, target: str) -> Path:
    """One fixed name per target, flat in the git dir (temp-file cleanup knows every name)."""
    return git_dir / (PREFIX + target.replace("/", "__"))


def all_paths(git_dir: Path) -> List[Path]:
    return [stored_path(git_dir, t) for t in TARGET_FILES]


def read_stored(git_dir: Path, target: str) -> Optional[bytes]:
    """The stored copy, None when absent or not a regular file of sane size (never followed)."""
    snap = fileio.snapshot(stored_path(git_dir, target))
    if snap.kind != "file" or len(snap.data) > MAX_BYTES:
        return None
    return snap.data


def find(checkout: Checkout, man: Manifest, target: str) -> Optional[bytes]:
    """The bytes whose sha256 the record holds as `before`, or None when none is left."""
    rec = man.files.get(target)
    if rec is None:
        return None
    candidates = (
        lambda: read_stored(checkout.git_dir, target),
        lambda: checkout.blob_at(man.commit, target),
        lambda: checkout.head_blob(target),
    )
    for get in candidates:
        data = get()
        if data is not None and fileio.sha256(data) == rec.before:
            return data
    return None
