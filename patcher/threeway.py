"""Take our edits out of a file the user changed since apply, keeping their changes.

Three versions of one file: `original` (before apply), `ours` (what apply wrote) and `current`
(on disk now). Our hunks are the diff ours -> original; the user's are the diff ours -> current.
Both are ranges of `ours`' lines, so when no user hunk touches one of ours (overlaps it or is
right next to it: a changed anchor line counts) the two sets are applied together to `ours`.
That is `git merge-file` with `ours` as the base, in a few lines we can report from: a conflict
names our hunk's lines and the user's, so the refusal says which edit is in the way.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

Hunk = Tuple[int, int, List[str]]  # lines [start, end) of `ours` replaced by these lines


@dataclass(frozen=True)
class Conflict:
    ours_lines: Tuple[int, int]  # 1-based, inclusive, in the applied file (ours)
    current_lines: Tuple[int, int]  # 1-based, inclusive, in the file on disk
    our_text: str  # the first line of what we wrote there, to name the edit


@dataclass
class Merge:
    result: bytes = b""
    conflicts: List[Conflict] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.conflicts


def _hunks(base: Sequence[str], other: Sequence[str]) -> List[Tuple[int, int, int, int]]:
    matcher = difflib.SequenceMatcher(None, base, other, autojunk=False)
    return [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def _touch(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    """Ranges of base lines that overlap or are adjacent (an insertion at a range's edge too)."""
    return a[0] <= b[1] and b[0] <= a[1]


def _span(start: int, end: int) -> Tuple[int, int]:
    return (start + 1, max(start + 1, end))


def take_out(original: bytes, ours: bytes, current: bytes) -> Merge:
    """`current` without our edits, or the conflicts that stop it (nothing half-merged)."""
    base = ours.decode("utf-8").splitlines(keepends=True)
    orig = original.decode("utf-8").splitlines(keepends=True)
    cur = current.decode("utf-8").splitlines(keepends=True)
    mine = _hunks(base, orig)
    theirs = _hunks(base, cur)
    merge = Merge()
    for i1, i2, _, _ in mine:
        for k1, k2, l1, l2 in theirs:
            if _touch((i1, i2), (k1, k2)):
                ours_text = next((s.strip() for s in base[i1:i2] if s.strip()), "")
                merge.conflicts.append(Conflict(_span(i1, i2), _span(l1, l2), ours_text))
    if merge.conflicts:
        return merge
    edits: List[Hunk] = [(i1, i2, orig[j1:j2]) for i1, i2, j1, j2 in mine]
    edits += [(k1, k2, cur[l1:l2]) for k1, k2, l1, l2 in theirs]
    out: List[str] = []
    at = 0
    for start, end, lines in sorted(edits, key=lambda h: (h[0], h[1])):
        out.extend(base[at:start])
        out.extend(lines)
        at = end
    out.extend(base[at:])
    merge.result = "".join(out).encode("utf-8")
    return merge
