"""An explicit state machine: one table of allowed transitions, one holder that logs and refuses
anything else. The controller's life cycle (control/controller/state.py) and a rank's recovery
(recovery/machine.py) are two tables held this way; this module is below both."""

from __future__ import annotations

import enum
import logging
import threading
from typing import FrozenSet, Generic, List, Mapping, Tuple, Type, TypeVar

log = logging.getLogger("mindio_ttp.controller")


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

    def move_from(self, olds: FrozenSet[E], new: E, why: str = "") -> bool:
        """Transition to `new` only if the state is one of `olds`, in one step (no other thread
        moves it between the look and the move); False, and no change, otherwise."""
        with self._lock:
            old = self._state
            if old not in olds:
                return False
            if new not in self._allowed[old]:
                raise self._error(f"{self._name}: {old.value} -> {new.value} is not allowed")
            self._state = new
            self.history.append((old, new, why))
        self._log.info("%s: %s -> %s%s", self._name, old.value, new.value,
                       f" ({why})" if why else "")
        return True

    def is_in(self, *states: E) -> bool:
        return self._state in states


