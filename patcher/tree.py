"""One opened Megatron checkout: its HEAD blobs, current files, manifest, and planned outputs.

Plans are always computed from the HEAD blobs (never from the files on disk), so "our patched
state" is one deterministic byte string per file and option set.

Opening a Tree takes the checkout's lock and rolls back whatever an interrupted run left
(patcher/journal.py), so every command starts from exactly clean or exactly applied. Every path
is read through `current`, which refuses symlinks, symlinked directories, non-regular files and
git modes other than 100644, and remembers the bytes: `write` refuses a file that changed since.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import fileio, journal, launch_script, manifest, originals
from .diffs import FileDiff
from .edits import TARGET_FILES
from .engine import FilePlan, plan_file
from .errors import MissingTarget, UnsafeTarget
from .lock import Lock
from .options import DEFAULT_PORT, PORT_RANGE, Device, Options
from .pin import Pin
from .repo import Checkout, open_checkout


@dataclass
class Tree:
    checkout: Checkout
    _manifest: Optional[manifest.Manifest] = None
    _manifest_loaded: bool = False
    _plans: Dict[Tuple[Optional[Device], Optional[int]], Dict[str, FilePlan]] = field(
        default_factory=dict
    )
    _head: Dict[str, bytes] = field(default_factory=dict)
    _seen: Dict[Path, Optional[bytes]] = field(default_factory=dict)
    _modes: Optional[Dict[str, str]] = None
    _lock: Optional[Lock] = None
    _pin: Optional[Pin] = None

    @classmethod
    def open(cls, directory: str) -> Tree:
        tree = cls(open_checkout(directory))
        try:
            tree._lock = Lock(tree.checkout.git_dir)
            tree._lock.acquire()
            if tree._lock.held:
                tree._recover()
        except BaseException:
            tree.close()
            raise
        return tree

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
        self.checkout.close()

    @property
    def journal(self) -> journal.Journal:
        git_dir = self.checkout.git_dir
        return journal.Journal(git_dir, {"git": git_dir, "tree": self.root}, self._ours())

    def _ours(self) -> List[Path]:
        """Every path ttp-patch ever writes: the targets, the script, the record, the copies."""
        ours = [self.path(p) for p in (*TARGET_FILES, launch_script.SCRIPT)]
        return ours + [self.manifest_path, *originals.all_paths(self.checkout.git_dir)]

    def _recover(self) -> None:
        restored = self.journal.recover()
        journal.report(restored, journal.remove_temps([*self._ours(), self.journal.path]))

    def write(self, changes: Sequence[fileio.Change]) -> None:
        """All or nothing, journaled, each file checked against what this Tree read of it."""
        for ch in changes:
            if ch.path.parent != self.checkout.git_dir:  # the record, stored originals
                self._check_path(ch.path.relative_to(self.root).as_posix())
        fileio.write_all(
            changes,
            journal=self.journal,
            expected=self._seen,
            inside=(self.root, self.checkout.git_dir),
        )

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def root(self) -> Path:
        return self.checkout.root

    @property
    def manifest_path(self) -> Path:
        return manifest.manifest_path(self.checkout.git_dir)

    def manifest(self) -> Optional[manifest.Manifest]:
        """The recorded apply; raises ManifestError when the record is corrupt."""
        if not self._manifest_loaded:
            data = manifest.read_bytes(self.manifest_path)
            self._seen[self.manifest_path] = data
            self._manifest = None if data is None else manifest.parse(data, self.manifest_path)
            self._manifest_loaded = True
        return self._manifest

    @property
    def pin(self) -> Pin:
        """What the edits were written for: 285068c's target blob ids (patcher/pin.py)."""
        if self._pin is None:
            self._pin = self.checkout.pin()
        return self._pin

    def head(self, path: str) -> bytes:
        if path not in self._head:
            self._head[path] = self.checkout.require_head_blob(path)
        return self._head[path]

    def path(self, rel: str) -> Path:
        return self.root / rel

    def current(self, rel: str) -> Optional[bytes]:
        """The file's bytes, None when absent; UnsafeTarget for anything we must not write."""
        self._check_path(rel)
        p = self.path(rel)
        data = fileio.snapshot(p).content
        self._seen[p] = data
        return data

    def _check_path(self, rel: str) -> None:
        where = self.root
        parts = Path(rel).parts
        hint = "ttp-patch only writes real files inside the work tree: `git checkout -- {}`"
        for i, part in enumerate(parts):
            where = where / part
            try:
                st = os.lstat(where)
            except FileNotFoundError:
                return
            shown = "/".join(parts[: i + 1])
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeTarget(
                    f"{shown} is a symlink (to {os.readlink(where)}); refusing to write {rel} "
                    "through it",
                    hint.format(shown) + " (after moving the link away)",
                )
            if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
                raise UnsafeTarget(f"{shown} is not a directory", hint.format(shown))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeTarget(
                f"{rel} exists but is not a regular file", f"move {rel} away, then run again"
            )
        mode = self._git_modes().get(rel)
        if mode is not None and mode != "100644":
            raise UnsafeTarget(
                f"{rel} has git mode {mode}, not 100644 (a regular, non-executable file)",
                f"restore it: git checkout -- {rel}",
            )

    def _git_modes(self) -> Dict[str, str]:
        """Index modes of the targets (`git ls-files -s`): a symlink or gitlink is not a target."""
        if self._modes is None:
            out = self.checkout.repo.git.ls_files("-s", "--", *TARGET_FILES)
            self._modes = {}
            for line in out.splitlines():
                meta, _, name = line.partition("\t")
                self._modes[name] = meta.split()[0]
        return self._modes

    def require_current(self, rel: str) -> bytes:
        data = self.current(rel)
        if data is None:
            raise MissingTarget(
                f"{rel} is missing from the work tree", f"restore it: git checkout -- {rel}"
            )
        return data

    def plans(self, opts: Options) -> Dict[str, FilePlan]:
        """Every target's patched bytes for `opts`, from HEAD; raises AnchorError on a bad HEAD."""
        key = (opts.device, opts.port)
        if key not in self._plans:
            self._plans[key] = {p: plan_file(p, self.head(p), opts) for p in TARGET_FILES}
        return self._plans[key]

    def script(self, opts: Options) -> bytes:
        assert opts.device is not None and opts.port is not None
        return launch_script.build(self.head(launch_script.EXAMPLE), opts.device, opts.port)

    def diffs(self, opts: Options) -> List[FileDiff]:
        assert opts.device is not None
        out = [FileDiff(p, plan.before, plan.after) for p, plan in self.plans(opts).items()]
        out.append(
            FileDiff(
                launch_script.SCRIPT, None, self.script(opts), launch_script.SCRIPT_MODE
            )
        )
        return out

    def inferred_options(self) -> List[Options]:
        """Option sets that may explain the files when no manifest says which was used."""
        port = DEFAULT_PORT
        training = self.current("megatron/training.py") or b""
        found = re.search(rb"^[ \t]+port = (\d+)[ \t]*$", training, flags=re.M)
        if found and PORT_RANGE[0] <= int(found.group(1)) <= PORT_RANGE[1]:
            port = int(found.group(1))
        return [Options(device=d, port=port) for d in Device]
