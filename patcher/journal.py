"""The intent journal: what a write phase is about to change, on disk before the first replace.

While .git/ttp-patch.journal exists a write phase is in progress or was killed (SIGKILL, power
loss). The next command, under the lock, rolls it back: every path goes back to the state the
journal saved, so an interrupted apply leaves the tree exactly clean and an interrupted revert
exactly applied. Rolling back (never forward) needs only the old states, which are small. A path
that is neither the old nor the new state was changed by hand since, and is refused rather than
overwritten. Temp files are ours by name; under the lock every one of them is a leftover.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import PatchError
from .fileio import TEMP_SUFFIX, Snapshot, fsync_dir, restore, sha256, snapshot, temp_file

JOURNAL_NAME = "ttp-patch.journal"
MAX_BYTES = 64 << 20  # the old states of a few source files; far above any real journal
SCHEMA = 1
log = logging.getLogger("ttp_patch")


class JournalError(PatchError):
    """The journal of an interrupted write cannot be rolled back safely by itself."""


class Journal:
    """`bases` names the directories paths are stored relative to, so a moved checkout recovers."""

    def __init__(
        self, git_dir: Path, bases: Dict[str, Path], ours: Optional[Iterable[Path]] = None
    ) -> None:
        self.path = git_dir / JOURNAL_NAME
        self.bases = bases
        # the only paths a rollback may touch: a journal naming any other (damaged, or written
        # by someone else) must not make recovery write .git/hooks or, through a link it
        # restored first, a file outside the tree
        self.ours = None if ours is None else frozenset(ours)

    def _split(self, path: Path) -> Tuple[str, str]:
        for name, base in self.bases.items():
            if path.parent == base or base in path.parents:
                return name, path.relative_to(base).as_posix()
        raise ValueError(f"{path} is outside {list(self.bases.values())}")  # pragma: no cover

    def begin(self, entries: Sequence[Tuple[Path, Snapshot, Optional[bytes]]]) -> None:
        """Durable before returning: written to a temp file, fsync'd, renamed, directory fsync'd."""
        doc = {"schema": SCHEMA, "pid": os.getpid(), "entries": []}
        for path, old, new in entries:
            base, rel = self._split(path)
            doc["entries"].append(
                {
                    "base": base,
                    "rel": rel,
                    "kind": old.kind,
                    "data": base64.b64encode(old.data).decode(),
                    "mode": old.mode,
                    "new": None if new is None else sha256(new),
                }
            )
        fd, tmp = temp_file(self.path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(doc).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(self.path.parent)

    def end(self) -> None:
        """The commit point (or the end of a rollback): without the journal nothing is pending."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fsync_dir(self.path.parent)

    def _load(self) -> List[Tuple[Path, Snapshot, Optional[str]]]:
        hint = (
            f"look at `git status` and {self.path}, put the files right by hand "
            "(git checkout -- FILE), then delete the journal"
        )
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                raise ValueError("too large")
            doc = json.loads(data)
            if doc["schema"] != SCHEMA:
                raise ValueError(f"schema {doc['schema']!r}")
            out = []
            for e in doc["entries"]:
                base = self.bases[e["base"]]
                rel = Path(e["rel"])
                if rel.is_absolute() or ".." in rel.parts:
                    raise ValueError(f"path {e['rel']!r}")
                if self.ours is not None and base / rel not in self.ours:
                    raise ValueError(f"path {e['rel']!r} is not one ttp-patch writes")
                if e["kind"] not in ("absent", "file", "symlink"):
                    raise ValueError(f"kind {e['kind']!r}")
                data = base64.b64decode(e["data"], validate=True)
                mode = e["mode"]
                if type(mode) is not int or not 0 <= mode <= 0o7777:
                    raise ValueError(f"mode {mode!r}")
                old = Snapshot(e["kind"], data, mode)
                new = e["new"]
                if new is not None and not isinstance(new, str):
                    raise ValueError(f"new {new!r}")
                out.append((base / rel, old, new))
            return out
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise JournalError(
                f"{self.path} (left by an interrupted ttp-patch) is unreadable: {exc!r}", hint
            ) from None

    def recover(self) -> List[Path]:
        """Roll back an interrupted write phase; the paths put back (empty: nothing pending)."""
        if not os.path.lexists(self.path):
            return []
        entries = self._load()
        restored = []
        for path, old, new in reversed(entries):
            now = snapshot(path)
            if now == old:
                continue
            ours = now.kind == "absent" if new is None else sha256(now.data) == new
            if now.kind == "symlink" or not ours:
                raise JournalError(
                    f"{path} changed after an interrupted ttp-patch and before this run",
                    f"keep your change elsewhere, `git checkout -- {path.name}`, then delete "
                    f"{self.path}",
                )
            restore(path, old)
            restored.append(path)
        self.end()
        return restored


def remove_temps(paths: Iterable[Path]) -> List[Path]:
    """Delete our temp files beside each path (`.NAME.*.ttp-tmp`); call only under the lock."""
    removed = []
    for path in paths:
        prefix = f".{path.name}."
        try:
            entries = list(os.scandir(path.parent))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(prefix) and entry.name.endswith(TEMP_SUFFIX):
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed.append(Path(entry.path))
    if removed:
        for d in {p.parent for p in removed}:
            fsync_dir(d)
    return removed


def report(restored: Sequence[Path], temps: Sequence[Path]) -> None:
    """Say on the log what recovery did: the user should know a past run was undone."""
    if restored:
        log.warning(
            "rolled back an interrupted apply/revert: put back %s",
            ", ".join(p.name for p in restored),
        )
    if temps:
        log.warning("removed %d leftover temp file(s) of an interrupted run", len(temps))
