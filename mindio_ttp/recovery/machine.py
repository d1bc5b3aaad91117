"""One rank's in-memory recovery as an explicit state machine.

One Enum, one table of allowed transitions, one `transition_to()` that logs and refuses anything
else. Two threads drive it: the processor's (orders from the controller: recover, commit,
abandon) and the training thread (leave the step, regroup, refill, verify). A transition the
table does not allow is a bug, and failing loudly beats training on with half-restored state.

    IDLE ──order──> ORDERED ──> STOPPING ──> REGROUPING ──> REFILLING ──> VERIFYING ──> READY
     │                                          ^                                         │
     └──replacement start──> JOINING ───────────┘                           commit ──> IDLE

Every state but IDLE may go to ABANDONED (the controller fell back to the dying checkpoint, or
this rank failed a step): the process then waits for the exit order like after any fault.
"""

from __future__ import annotations

import enum
import logging
from typing import Dict, FrozenSet

from mindio_ttp.statemachine import TableMachine

log = logging.getLogger("mindio_ttp.recovery")


class RecoveryState(enum.Enum):
    IDLE = "idle"  # training; no recovery in progress (also after a committed one)
    ORDERED = "ordered"  # survivor: the controller ordered a recovery; leaving the step
    JOINING = "joining"  # replacement: a fresh process started for a lost rank
    STOPPING = "stopping"  # survivor: out of the step; device work stopped, groups destroyed
    REGROUPING = "regrouping"  # Megatron's start-up again, on the recovery's store
    REFILLING = "refilling"  # state of the recovery's step moved in and rolled back
    VERIFYING = "verifying"  # hashes of every copy compared
    READY = "ready"  # reported ready; waiting for the controller's commit
    ABANDONED = "abandoned"  # fallback to the dying checkpoint (or this rank failed a step)


S = RecoveryState
_ACTIVE = frozenset({S.ORDERED, S.JOINING, S.STOPPING, S.REGROUPING, S.REFILLING, S.VERIFYING,
                     S.READY})
ALLOWED: Dict[RecoveryState, FrozenSet[RecoveryState]] = {
    S.IDLE: frozenset({S.ORDERED, S.JOINING}),
    S.ORDERED: frozenset({S.STOPPING, S.ABANDONED}),
    S.JOINING: frozenset({S.REGROUPING, S.ABANDONED}),
    S.STOPPING: frozenset({S.REGROUPING, S.ABANDONED}),
    S.REGROUPING: frozenset({S.REFILLING, S.ABANDONED}),
    S.REFILLING: frozenset({S.VERIFYING, S.ABANDONED}),
    S.VERIFYING: frozenset({S.READY, S.ABANDONED}),
    S.READY: frozenset({S.IDLE, S.ABANDONED}),
    S.ABANDONED: frozenset(),
}


class InvalidRecoveryTransition(RuntimeError):
    """A transition the table does not allow: a bug in the recovery, never a user error."""


class RecoveryMachine(TableMachine[RecoveryState]):
    """Thread-safe holder of one rank's recovery state, with its history for logs and tests."""

    def __init__(self, name: str = "recovery") -> None:
        super().__init__(name, S.IDLE, ALLOWED, InvalidRecoveryTransition, log)

    @property
    def active(self) -> bool:
        """A recovery is under way on this rank (not idle, not abandoned)."""
        return self.state in _ACTIVE

    def abandon(self, why: str) -> bool:
        """Move to ABANDONED from any active state; False when there was nothing to abandon."""
        if not self.active:
            return False
        try:
            self.transition_to(S.ABANDONED, why)
        except InvalidRecoveryTransition:  # raced with another abandon: already there
            return False
        return True
