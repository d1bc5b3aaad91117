"""Which bytes apply edits in each target, and whether it may: the pin check per file.

A target is patched from its bytes in the work tree. Without --allow-modified those must be
285068c's (blob id, patcher/pin.py), whatever commit HEAD is; a file that already is our output
(recorded, or our output of HEAD's pinned bytes) is left as it is. With --allow-modified any
bytes are patched as long as every edit's anchor is found exactly once where it belongs; the
engine's refusal names the file, the function and the edit otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from . import prerequisites
from .edits import TARGET_FILES
from .engine import decode, plan_file
from .errors import ModifiedTarget, PatchError, WrongCommit
from .fileio import sha256
from .options import Options
from .pin import Pin
from .repo import checkout_hint
from .tree import Tree

ALLOW_MODIFIED = "--allow-modified"


@dataclass
class TargetPlan:
    path: str
    original: bytes  # what revert gives back (the user's bytes before apply)
    after: bytes  # what the file holds once applied
    current: bytes

    @property
    def write(self) -> bool:
        return self.current != self.after


@dataclass
class Targets:
    plans: Dict[str, TargetPlan]
    head_differs: List[str]  # targets whose HEAD blob is not the pin's
    notes: List[str]  # one line each for stderr: which commit was found, what was accepted


def _ours_of_head(tree: Tree, path: str, current: bytes, opts: Options) -> Optional[bytes]:
    """HEAD's bytes when `current` is exactly our output of them (an apply without a record)."""
    head = tree.checkout.head_blob(path)
    if head is None or head == current:
        return None
    try:
        if plan_file(path, head, opts).after == current:
            return head
    except PatchError:
        return None
    return None


def plan_targets(tree: Tree, opts: Options, allow_modified: bool = False) -> Targets:
    """Every target's plan, or the refusal that names what differs from the pin and why."""
    pin = tree.pin
    man = tree.manifest()
    heads = tree.checkout.head_blob_ids()
    plans: Dict[str, TargetPlan] = {}
    not_pinned: List[str] = []
    for path in TARGET_FILES:
        current = tree.require_current(path)
        decode(path, current)  # CRLF / non-UTF-8 get their own, more useful message
        rec = man.files.get(path) if man is not None else None
        if rec is not None and sha256(current) == rec.after:
            plans[path] = TargetPlan(path, current, current, current)  # ours, as recorded
            continue
        if not pin.matches(path, current):
            head = _ours_of_head(tree, path, current, opts)
            if head is not None:
                plans[path] = TargetPlan(path, head, current, current)
                continue
            not_pinned.append(path)
            if not allow_modified:
                continue
        plans[path] = TargetPlan(path, current, plan_file(path, current, opts).after, current)
    head_differs = [p for p in TARGET_FILES if heads.get(p) != pin.blobs.get(p)]
    if not_pinned and not allow_modified:
        _refuse(tree, pin, not_pinned, head_differs)
    prerequisites.check(prerequisites.read(tree.root))
    return Targets(plans, head_differs, _notes(tree, pin, head_differs, not_pinned))


def _refuse(tree: Tree, pin: Pin, not_pinned: List[str], head_differs: List[str]) -> None:
    short = pin.commit[:7]
    at_head = [p for p in not_pinned if p in head_differs]
    if at_head:
        raise WrongCommit(
            f"{tree.root}: HEAD is {tree.checkout.commit}{tree.checkout.relation(pin.commit)}, "
            f"and its {', '.join(at_head)} differ from Megatron-LM {short}'s "
            "(the edits were written for those bytes)",
            f"{checkout_hint(tree.root, pin.commit)}; or `ttp-patch apply {ALLOW_MODIFIED}` "
            "patches other versions when every edit's anchor is found exactly once",
        )
    raise ModifiedTarget(
        "these files are neither as Megatron-LM 285068c ships them nor exactly what "
        f"ttp-patch writes: {', '.join(not_pinned)}",
        not_pinned,
        "`git diff` shows the changes: keep them elsewhere and `git checkout -- FILE` "
        "(or `ttp-patch revert` an apply made with other options); or patch your version with "
        f"`ttp-patch apply {ALLOW_MODIFIED}` (revert gives your bytes back)",
    )


def _notes(tree: Tree, pin: Pin, head_differs: List[str], not_pinned: List[str]) -> List[str]:
    short = pin.commit[:7]
    found = tree.checkout.commit
    notes: List[str] = []
    if found != pin.commit:
        relation = tree.checkout.relation(pin.commit).strip()
        same = [p for p in TARGET_FILES if p not in head_differs]
        if not head_differs:
            notes.append(
                f"found HEAD {found} {relation}: its {len(TARGET_FILES)} target files are "
                f"byte-identical to {short}'s"
            )
        else:
            notes.append(
                f"found HEAD {found} {relation}: {len(same)} of {len(TARGET_FILES)} target "
                f"files are {short}'s; differing: {', '.join(head_differs)}"
            )
    if not_pinned:
        notes.append(
            f"{ALLOW_MODIFIED}: patching {', '.join(not_pinned)} (not {short}'s bytes; every "
            "anchor matched exactly once)"
        )
    return notes
