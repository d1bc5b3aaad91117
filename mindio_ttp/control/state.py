"""The controller's life cycle as an explicit state machine.

One Enum, one table of allowed transitions, one `transition_to()` that logs and refuses
anything else: a bug that would, say, order a rename while still collecting state fails loudly
instead of writing a half checkpoint.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Dict, FrozenSet, List, Tuple

log = logging.getLogger("mindio_ttp.controller")


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


class InvalidTransition(RuntimeError):
    """A transition the table does not allow: a controller bug, never a user error."""


class StateMachine:
    """Thread-safe holder of the current state; keeps the history for logs and tests."""

    def __init__(self, name: str = "controller") -> None:
        self._name = name
        self._state = S.INIT
        self._lock = threading.Lock()
        self.history: List[Tuple[ControllerState, ControllerState, str]] = []

    @property
    def state(self) -> ControllerState:
        return self._state

    def transition_to(self, new: ControllerState, why: str = "") -> ControllerState:
        with self._lock:
            old = self._state
            if new not in ALLOWED[old]:
                log.error("%s: illegal transition %s -> %s (%s)", self._name, old.value,
                          new.value, why)
                raise InvalidTransition(f"{self._name}: {old.value} -> {new.value} is not "
                                        f"allowed (allowed: "
                                        f"{sorted(s.value for s in ALLOWED[old]) or 'none'})")
            self._state = new
            self.history.append((old, new, why))
        log.info("%s: %s -> %s%s", self._name, old.value, new.value, f" ({why})" if why else "")
        return old

    def is_in(self, *states: ControllerState) -> bool:
        return self._state in states
