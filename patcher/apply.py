"""`apply` and `diff`: preflight everything read-only, then write all files or none."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from . import launch_script
from .diffs import FileDiff, render
from .engine import decode
from .errors import ManifestError, ModifiedTarget
from .fileio import Change, check_writable, sha256
from .manifest import FileRecord, Manifest
from .options import Options
from .tree import Tree


@dataclass
class ApplyOutcome:
    written: List[str] = field(default_factory=list)  # relative paths changed (or to change)
    diff: str = ""
    dry_run: bool = False

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


def plan_apply(tree: Tree, opts: Options) -> ApplyOutcome:
    """Everything apply would do, checked, as diffs and a list of files; writes nothing."""
    assert opts.device is not None
    _check_recorded_options(tree, opts)
    plans = tree.plans(opts)
    diffs: List[FileDiff] = []
    modified: List[str] = []
    outcome = ApplyOutcome()
    for path, plan in plans.items():
        current = tree.require_current(path)
        if current == plan.before:
            if plan.changed:
                diffs.append(FileDiff(path, plan.before, plan.after))
                outcome.written.append(path)
        elif current != plan.after:
            decode(path, current)  # CRLF / non-UTF-8 get their own, more useful message
            modified.append(path)
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


def apply(directory: str, opts: Options, dry_run: bool = False) -> ApplyOutcome:
    with Tree.open(directory) as tree:
        outcome = plan_apply(tree, opts)
        outcome.dry_run = dry_run
        if dry_run or (outcome.noop and tree.manifest() is not None):
            return outcome
        plans = tree.plans(opts)
        script = tree.script(opts)
        record = Manifest(
            commit=tree.checkout.commit,
            device=opts.device.value,
            port=int(opts.port),
            files={p: FileRecord(sha256(pl.before), sha256(pl.after)) for p, pl in plans.items()},
            launch_script=sha256(script),
        )
        changes = [Change(tree.path(p), plans[p].after) for p in outcome.written if p in plans]
        if launch_script.SCRIPT in outcome.written:
            changes.append(
                Change(tree.path(launch_script.SCRIPT), script, launch_script.SCRIPT_MODE)
            )
        changes.append(Change(tree.manifest_path, record.to_json()))
        tree.write(changes)
        return outcome


def diff(directory: str, opts: Options) -> str:
    """What apply writes with `opts`, or, once applied, what it wrote (recorded options)."""
    with Tree.open(directory) as tree:
        man = tree.manifest()
        if man is not None:
            opts = man.options
        return render(tree.diffs(opts))
