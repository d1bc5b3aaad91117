"""`revert`: put every target back to the user's bytes before apply, remove script and record.

With a record, "before" is what the record's sha256 names (patcher/originals.py: HEAD's blob,
or the copy apply kept of an --allow-modified file); without one, HEAD's bytes. A file that is
exactly what apply wrote goes back whole. One the user changed since gets only our edits taken
out (patcher/threeway.py), proven by re-applying them: the result must give back the file on
disk byte for byte. A change touching one of our hunks, or a file we cannot prove, is drift:
listed (with the edit in the way) and refused unless --force, which restores the before bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import launch_script, manifest, originals
from .edits import TARGET_FILES, Edit, edits_for
from .engine import plan_file
from .errors import AnchorError, Drifted, ManifestError, PatchError, UnreadableTarget
from .fileio import Change, check_writable, sha256
from .manifest import Manifest
from .options import Options
from .threeway import Conflict, take_out
from .tree import Tree


@dataclass
class RevertOutcome:
    restored: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    drifted_forced: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)  # not ours, left alone even with --force
    merged: List[str] = field(default_factory=list)  # only our edits taken out, user's kept
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


def _edit_text_lines(edit: Edit, opts: Options) -> List[str]:
    texts = [
        getattr(edit, "replacement", ""),
        getattr(edit, "inserted", ""),
        f"@{edit.decorator}" if getattr(edit, "decorator", "") else "",
    ]
    if hasattr(edit, "inserted_source"):
        texts.append(edit.inserted_source(opts, []))
    if opts.device is not None and edit.id == "pretrain/adaptor-import":
        texts.append(opts.device.adaptor_import or "")
    return [line.strip() for t in texts for line in t.splitlines() if line.strip()]


# the edit a later change touches (None: not known), why revert refuses, and where (for status)
Reason = Tuple[Optional[Edit], str, str]


def _describe(path: str, c: Conflict, opts: Options) -> Reason:
    named = [e for e in edits_for(path) if c.our_text in _edit_text_lines(e, opts)]
    what = f"edit {named[0].id} ({named[0].number})" if named else "one of our edits"
    return (named[0] if named else None,
            f"{path}: your change at {_lines(c.current_lines)} touches {what} "
            f"(our {_lines(c.ours_lines)}: `{c.our_text}`)",
            f"changed by hand at {_lines(c.current_lines)} since apply")


def _unnamed(why: str) -> Reason:
    return (None, why, why)


def _lines(span: Tuple[int, int]) -> str:
    return f"line {span[0]}" if span[0] == span[1] else f"lines {span[0]}-{span[1]}"


def _without_our_edits(
    path: str, original: bytes, current: bytes, man: Manifest
) -> Tuple[Optional[bytes], List[Reason]]:
    """`current` minus our edits and nothing else, or why that cannot be proven."""
    opts = man.options
    try:
        ours = plan_file(path, original, opts).after
    except PatchError as exc:  # pragma: no cover - apply planned these very bytes
        return None, [_unnamed(f"{path}: cannot rebuild what apply wrote ({exc.message})")]
    if sha256(ours) != man.files[path].after:
        return None, [_unnamed(f"{path}: this ttp-patch would not write what the recorded "
                               "apply wrote")]
    try:
        merge = take_out(original, ours, current)
    except UnicodeDecodeError:
        return None, [_unnamed(f"{path}: not UTF-8 any more")]
    if not merge.clean:
        return None, [_describe(path, c, opts) for c in merge.conflicts]
    try:
        again = plan_file(path, merge.result, opts).after
    except PatchError as exc:
        again, why = None, exc.message
    else:
        why = "re-applying our edits to the result does not give your file back exactly"
    if again != current:
        return None, [_unnamed(f"{path}: {why}")]
    return merge.result, []


def later_changes(tree: Tree, man: Manifest, path: str, current: bytes) -> List[Reason]:
    """Why `revert` would refuse `path` as it is now (empty: it would take our edits out and
    keep the user's changes). `status` and `verify` ask the same question, so a hand edit
    inside one of our insertions reads as modified there too, not as applied."""
    rec = man.files[path]
    if sha256(current) in (rec.before, rec.after):
        return []
    before = originals.find(tree.checkout, man, path)
    if before is None:
        return [_unnamed(f"{path}: the bytes it had before apply are gone (no copy, not at "
                         "the recorded commit nor HEAD)")]
    return _without_our_edits(path, before, current, man)[1]


def revert(directory: str, force: bool = False) -> RevertOutcome:
    with Tree.open(directory) as tree:
        try:
            man = tree.manifest()
        except ManifestError:
            if not force:
                raise
            man = None
            cleared = manifest.clear_unreadable(tree.manifest_path)
        else:
            cleared = False
        outcome = RevertOutcome(
            manifest_removed=cleared or os.path.lexists(tree.manifest_path)
        )
        changes: List[Change] = []
        drift: List[str] = []
        why: List[str] = []
        for path in TARGET_FILES:
            current = tree.current(path)
            if man is not None and path in man.files:
                rec = man.files[path]
                if current is not None and sha256(current) == rec.before:
                    continue
                before = originals.find(tree.checkout, man, path)
                if before is None and not force:
                    raise ManifestError(
                        f"the bytes {path} had before apply (sha256 {rec.before[:12]}...) are "
                        f"gone: no copy in {tree.checkout.git_dir}, not at commit "
                        f"{man.commit[:12]} nor HEAD",
                        "`ttp-patch revert --force` restores HEAD's bytes instead",
                    )
                if before is None:
                    before = tree.head(path)
                    drift.append(path)
                elif current is not None and sha256(current) != rec.after:
                    merged, reasons = _without_our_edits(path, before, current, man)
                    if merged is not None:
                        before = merged
                        outcome.merged.append(path)
                    else:
                        drift.append(path)
                        why += [text for _, text, _ in reasons]
                elif current is None:
                    drift.append(path)
                changes.append(Change(tree.path(path), before))
                outcome.restored.append(path)
                continue
            head = tree.head(path)
            if current == head:
                continue
            if current is None:
                ours = False
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
            detail = "".join(f"\n  {w}" for w in why)
            raise Drifted(
                "changed since ttp-patch applied them (reverting would lose those changes): "
                + ", ".join(drift)
                + detail,
                drift,
                "save your changes elsewhere, then `ttp-patch revert --force` restores the "
                "files as they were before apply and removes the script",
            )
        outcome.drifted_forced = drift
        if outcome.manifest_removed:
            changes.append(Change(tree.manifest_path, None))
        for stored in originals.all_paths(tree.checkout.git_dir):
            if os.path.lexists(stored):
                changes.append(Change(stored, None))
        for ch in changes:
            if ch.new is not None:
                check_writable(ch.path, str(ch.path.relative_to(tree.root)))
        tree.write(changes)
        return outcome
