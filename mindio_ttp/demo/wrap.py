"""The demo's lines, wrapped on word boundaries at the terminal's width.

Runtime and ttprun lines are long (a checkpoint path, a reason with ranks and steps); cutting
them at a fixed column dropped the end of the sentence, often the part that says what to do.
A wrapped line keeps its lead ("      " or "    | ") and indents its continuation by two
more; a word longer than the width (a path) stays whole on a line of its own.
"""

from __future__ import annotations

import re
import shutil
import textwrap
from typing import Optional

_LEAD = re.compile(r"^(\s*(?:\|\s)?)")


def wrap(text: str, width: Optional[int] = None) -> str:
    width = width or max(60, shutil.get_terminal_size((100, 24)).columns)
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = _LEAD.match(line).group(1)  # type: ignore[union-attr]
        out += textwrap.wrap(line[len(lead):], width, initial_indent=lead,
                             subsequent_indent=lead + "  ", break_long_words=False,
                             break_on_hyphens=False) or [line]
    return "\n".join(out)
