"""A rank's processor's life cycle as an explicit state machine, like the controller's
(control/controller/state.py).

The questions the rest of the runtime asks of a rank ("is a fault being handled?", "is this rank
still protected?", "may it still exit once?") used to be three flags set in a dozen places. Here
they are one state, and a change the table lacks fails loudly: in the processor's thread an
InvalidTransition ends the rank with a no-verdict exit and the error (processor.py `_loop`),
instead of, say, a second exit record after the first.

The connection (direct, through the node agent, failing over) is not part of this state: a rank
fails over in any state, and what it does after depends on where it was.
"""

from __future__ import annotations

import enum
import logging
from typing import Dict, FrozenSet

from mindio_ttp.statemachine import TableMachine

log = logging.getLogger("mindio_ttp.processor")


class RankState(enum.Enum):
    INIT = "init"  # created, not registered with a controller yet
    TRAINING = "training"  # registered, no fault: heartbeats, store calls
    FAULT = "fault"  # a fault seen (reported, a lock or save order, the controller lost):
    # training is locked, TTP_OT counts until the controller's exit order
    RECOVERING = "recovering"  # an in-memory recovery is ordered (docs/recovery.md): back to
    # TRAINING once committed, to FAULT when the controller falls back to the dying checkpoint
    UNPROTECTED = "unprotected"  # the controller closed (end of training): losing it is no fault
    EXITING = "exiting"  # the exit order was carried out (or no verdict came): once only
    STOPPED = "stopped"  # shut down at the end of training


S = RankState
LIVE = frozenset({S.TRAINING, S.FAULT, S.RECOVERING})
ALLOWED: Dict[RankState, FrozenSet[RankState]] = {
    S.INIT: frozenset({S.TRAINING, S.STOPPED}),
    S.TRAINING: frozenset({S.FAULT, S.RECOVERING, S.UNPROTECTED, S.EXITING, S.STOPPED}),
    # FAULT -> TRAINING: a recovery committed that found this rank locked (its own report or a
    # lock came first)
    S.FAULT: frozenset({S.TRAINING, S.RECOVERING, S.UNPROTECTED, S.EXITING, S.STOPPED}),
    S.RECOVERING: frozenset({S.TRAINING, S.FAULT, S.UNPROTECTED, S.EXITING, S.STOPPED}),
    S.UNPROTECTED: frozenset({S.EXITING, S.STOPPED}),
    S.EXITING: frozenset({S.STOPPED}),
    S.STOPPED: frozenset({S.EXITING}),  # the thread's own failure after a shutdown still exits
}


class RankMachine(TableMachine[RankState]):
    """One rank's: starts in INIT, follows ALLOWED."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank}", S.INIT, ALLOWED, logger=log)

    @property
    def fault_seen(self) -> bool:
        """A fault is being handled: a collective that fails now failed because of it."""
        return self.state in (S.FAULT, S.RECOVERING)

    @property
    def protected(self) -> bool:
        """Losing the controller now is a fault (not after it closed, or after goodbye)."""
        return self.state in LIVE
