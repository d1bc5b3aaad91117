"""`revert`: put every target back to its exact HEAD bytes, remove the script and the record.

A file is only overwritten when we can prove nothing but our edits is in it (its hash is the
recorded post-apply hash, or it equals our output for the options the files show); anything
else is drift, listed and refused unless --force.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from . import launch_script
from .edits import TARGET_FILES
from .errors import AnchorError, Drifted, ManifestError, UnreadableTarget
from .fileio import Change, check_writable, sha256
from .manifest import Manifest
from .tree import Tree


@dataclass
class RevertOutcome:
    restored: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    drifted_forced: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)  # not ours, left alone even with --force
    manifest_removed: bool = False

    @property
    def nothing_to_do(self) -> bool:
        return not (self.restored or self.removed or self.manifest_removed)


def _ours_without_record(tree: Tree, path: str, current: bytes) -> bool:
    for opts in tree.inferred_options():
        try:
            if tree.plans(opts)[path].after == current:
                return True
        except (AnchorError, UnreadableTarget):
            return False
    return False


def _script_ours(tree: Tree, man: Optional[Manifest], current: bytes) -> bool:
    if man is not None:
        return man.launch_script == sha256(current)
    return any(tree.script(o) == current for o in tree.inferred_options())


def revert(directory: str, force: bool = False) -> RevertOutcome:
    with Tree.open(directory) as tree:
        try:
            man = tree.manifest()
        except ManifestError:
            if not force:
                raise
            man = None
        outcome = RevertOutcome(manifest_removed=os.path.lexists(tree.manifest_path))
        changes: List[Change] = []
        drift: List[str] = []
        for path in TARGET_FILES:
            head = tree.head(path)
            current = tree.current(path)
            if current == head:
                continue
            if current is None:
                ours = False
            elif man is not None and path in man.files:
                ours = man.files[path].after == sha256(current)
            else:
                ours = _ours_without_record(tree, path, current)
            if not ours:
                drift.append(path)
            changes.append(Change(tree.path(path), head))
            outcome.restored.append(path)
        script = tree.current(launch_script.SCRIPT)
        if script is not None:
            if _script_ours(tree, man, script):
                outcome.removed.append(launch_script.SCRIPT)
            elif man is not None or launch_script.looks_generated(script):
                drift.append(launch_script.SCRIPT)
                outcome.removed.append(launch_script.SCRIPT)
            else:
                outcome.kept.append(launch_script.SCRIPT)  # the user's own file, never ours
            if launch_script.SCRIPT in outcome.removed:
                changes.append(Change(tree.path(launch_script.SCRIPT), None))
        if drift and not force:
            raise Drifted(
                "changed since ttp-patch applied them (reverting would lose those changes): "
                + ", ".join(drift),
                drift,
                "save your changes elsewhere, then `ttp-patch revert --force` restores HEAD "
                "and removes the script",
            )
        outcome.drifted_forced = drift
        if outcome.manifest_removed:
            changes.append(Change(tree.manifest_path, None))
        for ch in changes:
            if ch.new is not None:
                check_writable(ch.path, str(ch.path.relative_to(tree.root)))
        tree.write(changes)
        return outcome
