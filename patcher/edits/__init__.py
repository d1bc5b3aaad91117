"""The guide's 14 edits in EDITS.md order, plus ttp-patch's own: 0 (the torch compatibility
layer), 2.9-2.10 and 6.3 (the in-memory recovery's hooks), 3.3 (an early check of the
optimizer flags) and 6.1-6.2 (the process-group timeout from the runtime), grouped by the file
they change."""

from __future__ import annotations

from typing import List

from . import initialize, optimizer_init, parallel_state, pretrain_gpt, training
from .base import Assessment, Edit, FileIndex, State

ALL_EDITS: List[Edit] = [
    *pretrain_gpt.EDITS,
    *training.EDITS,
    *optimizer_init.EDITS,
    *parallel_state.EDITS,
    *initialize.EDITS,
]

TARGET_FILES: List[str] = [
    pretrain_gpt.FILE,
    training.FILE,
    optimizer_init.FILE,
    parallel_state.FILE,
    initialize.FILE,
]


def edits_for(path: str) -> List[Edit]:
    return [e for e in ALL_EDITS if e.file == path]


__all__ = ["ALL_EDITS", "TARGET_FILES", "Assessment", "Edit", "FileIndex", "State", "edits_for"]
