"""The controller's life cycle as an explicit state machine.

One Enum, one table of allowed transitions, one `transition_to()` that logs and refuses
anything else: a bug that would, say, order a rename while still collecting state fails loudly
instead of writing a half checkpoint. `TableMachine` is that holder for any such table: the
controller's here, a rank's recovery in recovery/machine.py.
"""

from __future__ import annotations

import enum
import logging
from typing import Dict, FrozenSet

from mindio_ttp.statemachine import InvalidTransition, TableMachine

log = logging.getLogger("mindio_ttp.controller")

__all__ = ["ALLOWED", "ControllerState", "InvalidTransition", "StateMachine", "TableMachine"]


class ControllerState(enum.Enum):
    INIT = "init"  # created, not listening yet
    STANDBY = "standby"  # backup: listening, takes over once enough processors fail over to it
    SERVING = "serving"  # active controller, no fault
    COLLECTING = "collecting"  # fault seen: locking ranks and collecting their state
    RECOVERING = "recovering"  # in-memory recovery ordered (docs/recovery.md); back to
    # SERVING once committed, on to the dying checkpoint (SAVING / EXITING) if it fails
    SAVING = "saving"  # save orders sent to the chosen ranks
    RENAMING = "renaming"  # every save succeeded; rename ordered on one rank
    EXITING = "exiting"  # exit orders sent to every process
    STOPPED = "stopped"  # closed (normal end of training, or after the exit orders)


S = ControllerState
ALLOWED: Dict[ControllerState, FrozenSet[ControllerState]] = {
    S.INIT: frozenset({S.SERVING, S.STANDBY, S.STOPPED}),
    S.STANDBY: frozenset({S.SERVING, S.STOPPED}),
    S.SERVING: frozenset({S.COLLECTING, S.STOPPED}),
    S.COLLECTING: frozenset({S.RECOVERING, S.SAVING, S.EXITING, S.STOPPED}),
    S.RECOVERING: frozenset({S.SERVING, S.SAVING, S.EXITING, S.STOPPED}),
    S.SAVING: frozenset({S.RENAMING, S.EXITING, S.STOPPED}),
    S.RENAMING: frozenset({S.EXITING, S.STOPPED}),
    S.EXITING: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}


class StateMachine(TableMachine[ControllerState]):
    """The controller's: starts in INIT, follows ALLOWED."""

    def __init__(self, name: str = "controller") -> None:
        super().__init__(name, S.INIT, ALLOWED)
