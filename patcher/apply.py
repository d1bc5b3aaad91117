"""`apply` and `diff`: preflight everything read-only, then write all files or none."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List

from . import launch_script, originals
from .diffs import FileDiff, render
from .edits import TARGET_FILES
from .engine import plan_file
from .errors import ManifestError, ModifiedTarget
from .fileio import Change, check_writable, sha256
from .manifest import FileRecord, Manifest
from .options import Options
from .targets import TargetPlan, plan_targets
from .tree import Tree


@dataclass
class ApplyOutcome:
    written: List[str] = field(default_factory=list)  # relative paths changed (or to change)
    diff: str = ""
    dry_run: bool = False
    notes: List[str] = field(default_factory=list)  # for stderr: the commit found, --allow-modified
    targets: Dict[str, TargetPlan] = field(default_factory=dict)

    @property
    def noop(self) -> bool:
        return not self.written


def _check_recorded_options(tree: Tree, opts: Options) -> None:
    man = tree.manifest()
    if man is None:
        return
    if (man.device, man.port) != (opts.device.value, opts.port):
        raise ModifiedTarget(
            f"already applied with --device {man.device} --port {man.port}, "
            f"not --device {opts.device.value} --port {opts.port}",
            list(man.files),
            f"run `ttp-patch revert {tree.root}` first, then apply with the new options",
        )


def plan_apply(tree: Tree, opts: Options, allow_modified: bool = False) -> ApplyOutcome:
    """Everything apply would do, checked, as diffs and a list of files; writes nothing."""
    assert opts.device is not None
    _check_recorded_options(tree, opts)
    targets = plan_targets(tree, opts, allow_modified)
    diffs: List[FileDiff] = []
    modified: List[str] = []
    outcome = ApplyOutcome(notes=targets.notes)
    for path, plan in targets.plans.items():
        if plan.write:
            diffs.append(FileDiff(path, plan.current, plan.after))
            outcome.written.append(path)
    outcome.targets = targets.plans
    script = tree.script(opts)
    current_script = tree.current(launch_script.SCRIPT)
    if current_script is None:
        diffs.append(FileDiff(launch_script.SCRIPT, None, script, launch_script.SCRIPT_MODE))
        outcome.written.append(launch_script.SCRIPT)
    elif current_script != script:
        modified.append(launch_script.SCRIPT)
    if modified:
        raise ModifiedTarget(
            "these files are neither as Megatron-LM 285068c ships them nor exactly what "
            f"`ttp-patch apply {opts.describe()}` writes: {', '.join(modified)}",
            modified,
            "`git diff` shows the changes: keep them elsewhere, `git checkout -- FILE` "
            "(move away a pretrain_gpt_ttp.sh of your own), or `ttp-patch revert` an apply "
            "made with other options; then apply again",
        )
    if tree.manifest() is not None and outcome.written:
        raise ManifestError(
            f"{tree.manifest_path} records an apply, but {', '.join(outcome.written)} "
            "is not patched (reset by git?): the record is stale",
            f"run `ttp-patch revert {tree.root}` to clear it, then apply again",
        )
    for path in outcome.written:
        check_writable(tree.path(path), path)
    outcome.diff = render(diffs)
    return outcome


def _originals_changes(tree: Tree, plans: Dict[str, TargetPlan]) -> List[Change]:
    """Copies of the user's bytes that git cannot give back (not HEAD's); stale copies go."""
    out = []
    for path, plan in plans.items():
        stored = originals.stored_path(tree.checkout.git_dir, path)
        if plan.original != tree.checkout.head_blob(path):
            out.append(Change(stored, plan.original))
        elif os.path.lexists(stored):
            out.append(Change(stored, None))
    return out


def apply(
    directory: str, opts: Options, dry_run: bool = False, allow_modified: bool = False
) -> ApplyOutcome:
    with Tree.open(directory) as tree:
        outcome = plan_apply(tree, opts, allow_modified)
        outcome.dry_run = dry_run
        if dry_run or (outcome.noop and tree.manifest() is not None):
            return outcome
        plans = outcome.targets
        script = tree.script(opts)
        record = Manifest(
            commit=tree.checkout.commit,
            device=opts.device.value,
            port=int(opts.port),
            files={p: FileRecord(sha256(pl.original), sha256(pl.after)) for p, pl in plans.items()},
            launch_script=sha256(script),
        )
        changes = [Change(tree.path(p), plans[p].after) for p in outcome.written if p in plans]
        if launch_script.SCRIPT in outcome.written:
            changes.append(
                Change(tree.path(launch_script.SCRIPT), script, launch_script.SCRIPT_MODE)
            )
        changes += _originals_changes(tree, plans)
        changes.append(Change(tree.manifest_path, record.to_json()))
        tree.write(changes)
        return outcome


def diff(directory: str, opts: Options) -> str:
    """What apply writes with `opts`, or, once applied, what it wrote (recorded options)."""
    with Tree.open(directory) as tree:
        man = tree.manifest()
        if man is None:
            return render(tree.diffs(opts))
        opts = man.options
        diffs = []
        for path in TARGET_FILES:  # from the user's bytes the record names (HEAD's mostly)
            base = originals.find(tree.checkout, man, path) or tree.head(path)
            diffs.append(FileDiff(path, base, plan_file(path, base, opts).after))
        script = tree.script(man.options)
        diffs.append(FileDiff(launch_script.SCRIPT, None, script, launch_script.SCRIPT_MODE))
        return render(diffs)
