"""Git-style unified diffs of what apply changes, and their parsed summary (via unidiff).

The text is what `git diff` would print for the same change (a/ b/ prefixes, `new file mode`,
`\\ No newline at end of file`), so `git apply` takes it on a pristine checkout.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import List, Optional, Sequence

import unidiff


@dataclass(frozen=True)
class FileDiff:
    path: str
    before: Optional[bytes]  # None: the file is new
    after: Optional[bytes]  # None: the file is deleted
    mode: int = 0o644


def _lines(data: bytes) -> List[str]:
    lines = data.decode("utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines


def render_one(d: FileDiff) -> str:
    if d.before == d.after:
        return ""
    head = [f"diff --git a/{d.path} b/{d.path}\n"]
    if d.before is None:
        head.append(f"new file mode 100{d.mode:o}\n")
    elif d.after is None:
        head.append(f"deleted file mode 100{d.mode:o}\n")
    src = "/dev/null" if d.before is None else f"a/{d.path}"
    dst = "/dev/null" if d.after is None else f"b/{d.path}"
    body = difflib.unified_diff(
        _lines(d.before or b""), _lines(d.after or b""), fromfile=src, tofile=dst, n=3
    )
    text = "".join(body)
    # difflib writes "@@ -0,0 +1,N @@" for a new file like git does; keep its headers.
    return "".join(head) + text


def render(diffs: Sequence[FileDiff]) -> str:
    return "".join(render_one(d) for d in diffs)


@dataclass(frozen=True)
class FileSummary:
    path: str
    added: int
    removed: int
    new: bool


def summarize(text: str) -> List[FileSummary]:
    """Files and +/- counts of a diff; raises unidiff.UnidiffParseError on a malformed one."""
    patch = unidiff.PatchSet(text)
    return [FileSummary(f.path, f.added, f.removed, f.is_added_file) for f in patch]
