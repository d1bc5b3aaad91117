"""The controller's life cycle as an explicit state machine.

One Enum, one table of allowed transitions, one `transition_to()` that logs and refuses
anything else: a bug that would, say, order a rename while still collecting state fails loudly
instead of writing a half checkpoint. `TableMachine` is that holder for any such table: the
controller's here, a rank's recovery in recovery/machine.py.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Dict, FrozenSet, Generic, List, Mapping, Tuple, Type, TypeVar

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


E = TypeVar("E", bound=enum.Enum)


class TableMachine(Generic[E]):
    """Thread-safe holder of the current state of one table of allowed transitions; keeps the
    history for logs and tests. A transition the table lacks raises `error` (a bug)."""

    def __init__(self, name: str, initial: E, allowed: Mapping[E, FrozenSet[E]],
                 error: Type[RuntimeError] = InvalidTransition,
                 logger: logging.Logger = log) -> None:
        self._name = name
        self._state = initial
        self._allowed = allowed
        self._error = error
        self._log = logger
        self._lock = threading.Lock()
        self.history: List[Tuple[E, E, str]] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def state(self) -> E:
        return self._state

    def transition_to(self, new: E, why: str = "") -> E:
        with self._lock:
            old = self._state
            if new not in self._allowed[old]:
                self._log.error("%s: illegal transition %s -> %s (%s)", self._name, old.value,
                                new.value, why)
                raise self._error(f"{self._name}: {old.value} -> {new.value} is not allowed "
                                  f"(allowed: "
                                  f"{sorted(s.value for s in self._allowed[old]) or 'none'})")
            self._state = new
            self.history.append((old, new, why))
        self._log.info("%s: %s -> %s%s", self._name, old.value, new.value,
                       f" ({why})" if why else "")
        return old

    def is_in(self, *states: E) -> bool:
        return self._state in states


class StateMachine(TableMachine[ControllerState]):
    """The controller's: starts in INIT, follows ALLOWED."""

    def __init__(self, name: str = "controller") -> None:
        super().__init__(name, S.INIT, ALLOWED)
