"""`status` and `verify`: the state of every edit, read from the files themselves (AST).

Nothing here needs the manifest to be right: it only lends the device when present, so a tree
patched by hand following the guide reads as applied too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from . import launch_script
from .edits import TARGET_FILES, State, edits_for
from .engine import assess_module, parse
from .errors import EXIT_NOT_APPLIED, EXIT_OK, UnreadableTarget
from .fileio import sha256
from .manifest import Manifest
from .options import Device, Options
from .revert import later_changes
from .tree import Tree

SCRIPT_ID = "launch/pretrain-gpt-ttp-sh"


@dataclass
class Row:
    id: str
    number: str
    file: str
    state: str
    detail: str = ""


@dataclass
class StatusReport:
    directory: str
    commit: str
    device: Optional[str]
    manifest: bool
    rows: List[Row] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    # a later change revert refuses that no single edit could be named for
    unattributed: List[str] = field(default_factory=list)

    @property
    def overall(self) -> str:
        states = {r.state for r in self.rows}
        if State.DRIFTED.value in states:
            return "drifted"
        if State.MODIFIED.value in states or self.unattributed:
            return "modified"
        if states == {State.APPLIED.value}:
            return "applied"
        if states == {State.MISSING.value}:
            return "clean"
        return "partial"

    @property
    def verify_exit_code(self) -> int:
        """The CI gate: 0 only when every edit is in place and nothing drifted."""
        return EXIT_OK if self.overall == "applied" else EXIT_NOT_APPLIED

    @property
    def status_exit_code(self) -> int:
        """`status` fails only when the tree is not what ttp-patch can stand behind: an edit
        drifted, or one changed by hand since apply (which revert refuses)."""
        return EXIT_NOT_APPLIED if self.overall in ("drifted", "modified") else EXIT_OK

    def to_json(self) -> str:
        doc = {
            "schema": 1,
            "directory": self.directory,
            "commit": self.commit,
            "device": self.device,
            "manifest": self.manifest,
            "overall": self.overall,
            "edits": [asdict(r) for r in self.rows],
            "notes": self.notes,
        }
        return json.dumps(doc, indent=2)

    def to_text(self) -> str:
        width = max(len(r.id) for r in self.rows)
        fwidth = max(len(r.file) for r in self.rows)
        lines = [f"{'#':<4} {'edit':<{width}}  {'file':<{fwidth}}  state"]
        for r in self.rows:
            detail = f"  ({r.detail})" if r.detail else ""
            lines.append(f"{r.number:<4} {r.id:<{width}}  {r.file:<{fwidth}}  {r.state}{detail}")
        device = self.device or "unknown (no adaptor import, no record)"
        lines.append(f"overall: {self.overall}   device: {device}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines) + "\n"


def _script_row(tree: Tree, recorded: Optional[str]) -> Row:
    row = Row(SCRIPT_ID, "5", launch_script.SCRIPT, State.MISSING.value)
    data = tree.current(launch_script.SCRIPT)
    if data is None:
        return row
    if recorded is not None and sha256(data) == recorded:
        row.state, row.detail = State.APPLIED.value, "as written by apply"
    elif b"\nttprun " in data and b"TTP_OT=" in data:
        row.state, row.detail = State.APPLIED.value, "launches with ttprun"
    else:
        row.state, row.detail = State.DRIFTED.value, "exists but does not launch with ttprun"
    return row


def _number(number: str) -> tuple:
    return tuple(int(part) for part in number.split("."))


def _later_changes(report: StatusReport, tree: Tree, man: Manifest, path: str,
                   data: bytes) -> None:
    """A file changed since apply: the edits the change touches read "modified" (as revert
    sees them: it refuses them), and a change outside every edit is a note."""
    rec = man.files[path]
    if sha256(data) in (rec.before, rec.after):
        return
    reasons = later_changes(tree, man, path, data)
    if not reasons:
        report.notes.append(f"{path} changed after apply, outside ttp-patch's edits (revert "
                            "keeps your change and takes out only ours)")
        return
    rows = {r.id: r for r in report.rows}
    for edit, why, where in reasons:
        row = rows.get(edit.id) if edit is not None else None
        if row is None:
            report.unattributed.append(why)
            report.notes.append(f"modified after apply: {why} (revert refuses it; "
                                "`revert --force` drops the change)")
        elif row.state == State.APPLIED.value:
            row.state = State.MODIFIED.value
            row.detail = f"{where}: revert refuses it, `revert --force` drops the change"


def status(directory: str, device: Optional[str] = None) -> StatusReport:
    with Tree.open(directory) as tree:
        man = tree.manifest()
        dev = Device(device) if device else (Device(man.device) if man else None)
        opts = Options(device=dev, port=None)
        report = StatusReport(
            str(tree.root), tree.checkout.commit, dev.value if dev else None, man is not None
        )
        for path in TARGET_FILES:
            edits = edits_for(path)
            data = tree.current(path)
            try:
                if data is None:
                    raise UnreadableTarget("file is missing")
                results = assess_module(path, parse(path, data), opts)
            except UnreadableTarget as exc:
                report.rows += [
                    Row(e.id, e.number, path, State.DRIFTED.value, exc.message) for e in edits
                ]
                continue
            for edit, res in results:
                report.rows.append(Row(edit.id, edit.number, path, res.state.value, res.detail))
                shown = res.inferred.get("device")
                if shown is not None and report.device is None:
                    report.device = shown.value
            if man is not None and path in man.files and data is not None:
                _later_changes(report, tree, man, path, data)
        script = _script_row(tree, man.launch_script if man else None)
        # in the order of the edits' numbers: 5 (the script) before 6.x
        at = next((i for i, r in enumerate(report.rows) if _number(r.number) > (5,)),
                  len(report.rows))
        report.rows.insert(at, script)
        if man is not None and report.overall == "clean":
            report.notes.append(f"{tree.manifest_path} is stale: `ttp-patch revert` clears it")
        return report
