"""The controller's side of an in-memory recovery: order it, wait for every rank, commit.

The flow (control/controller/flow.py) calls `run` from its thread once `plan_recovery` said yes; the
controller's I/O thread calls `ready`, `replace_status`, `replacement_registered` and `fault`,
always holding the controller's condition. `run` returns whether the recovery committed; when
it did not, the flow goes on to the dying checkpoint of the same step (the survivors never
changed their optimizer state), and `reason` says why.

The new world's rendezvous is a namespace of this controller's authenticated store
(control/rank/authstore.py): every rank reaches it over its own TTP connection (a replacement
registers first), so nothing an outsider can write decides who joins. The patched
megatron/initialize.py hands it to `init_process_group` (edit 6.3, `mega.process_group_store`).
It stays open until the next recovery opens its own, or the controller stops.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.recovery_plan import RecoveryPlan
from mindio_ttp.control.controller.roster import Roster
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.recovery.rank import RECOVERY, format_address

log = logging.getLogger("mindio_ttp.controller")


class RecoveryCoordinator:
    def __init__(self, cfg: TTPConfig, world_size: int, name: str, cond: threading.Condition,
                 roster: Roster, outbox: Any, address: Callable[[], Tuple[str, int]],
                 close_store: Callable[[str], None] = lambda ns: None) -> None:
        self.cfg, self.world_size, self.name = cfg, world_size, name
        self._cond = cond
        self._ranks = roster
        self._out = outbox
        self._address = address
        self._close_store = close_store
        self._namespace: Optional[str] = None  # the current world's rendezvous
        self.recovery_id = 0
        self._committed = 0  # recoveries this coordinator committed
        self._plan: Optional[RecoveryPlan] = None
        self._ready: Dict[int, P.RecoverReady] = {}
        self._failed = ""
        self.timeline: Dict[str, float] = {}

    @property
    def epoch(self) -> int:
        """Recoveries the job has committed, as far as this controller knows: a promoted
        standby learns the count from its own rank (RECOVERY.epoch); the controller process,
        which trains nothing, from the recoveries it committed itself."""
        return max(RECOVERY.epoch, self._committed)

    # -- called by the controller's I/O thread, holding the condition ---------------------------
    @property
    def expecting(self) -> Set[int]:
        """Lost ranks whose replacement may register now."""
        return set(self._plan.lost) if self._plan is not None else set()

    def replacement_registered(self, rank: int) -> None:
        log.info("%s: replacement for rank %d registered", self.name, rank)
        self.timeline.setdefault(f"registered-{rank}", time.monotonic())

    def ready(self, msg: P.RecoverReady, rank: int, peer: str = "") -> None:
        """Rank `rank` (the sender, from `peer`) says it is ready, or why not."""
        if self._plan is None or msg.recovery_id != self.recovery_id:
            return
        if msg.rank != rank:
            log.warning("%s: refused RecoverReady for rank %d from rank %d (%s): a rank "
                        "speaks for itself only", self.name, msg.rank, rank, peer)
            return
        self._ready[rank] = msg
        if not msg.ok and not self._failed:
            self._failed = f"rank {rank} failed the recovery: {msg.detail}"
        self._cond.notify_all()

    def replace_status(self, msg: P.ReplaceStatus, sender: int, peer: str = "") -> None:
        """What the launcher did with the request for `msg.rank`, as relayed by `sender` (from
        `peer`). Only the relay the plan chose for a lost rank speaks for its replacement: a
        key holder that is not used to abandon the recovery in another launcher's name (a
        `failed` for rank 1 from rank 3, and the log blamed rank 1's launcher)."""
        plan = self._plan
        if plan is None or msg.recovery_id != self.recovery_id:
            return
        if msg.rank not in plan.lost or plan.relays.get(msg.rank) != sender:
            why = (f"rank {msg.rank} is not replaced in recovery {msg.recovery_id}"
                   if msg.rank not in plan.lost else
                   f"its relay is rank {plan.relays[msg.rank]}")
            log.warning("%s: refused ReplaceStatus %s for rank %d from rank %d (%s): %s",
                        self.name, msg.state, msg.rank, sender, peer, why)
            return
        log.info("%s: replacement of rank %d: %s (pid %d) %s (relayed by rank %d, %s)",
                 self.name, msg.rank, msg.state, msg.pid, msg.detail, sender, peer)
        if msg.state == "started":
            self.timeline.setdefault(f"started-{msg.rank}", time.monotonic())
        elif not self._failed:
            self._failed = (f"the replacement for rank {msg.rank} {msg.state}: "
                            f"{msg.detail or 'no detail'}")
            self._cond.notify_all()

    def fault(self, desc: str) -> None:
        """Another fault while recovering: give the recovery up (the dying checkpoint next)."""
        if self._plan is not None and not self._failed:
            self._failed = f"another fault during the recovery: {desc}"
            self._cond.notify_all()

    # -- the flow's thread ----------------------------------------------------------------------
    def run(self, flow_id: int, plan: RecoveryPlan) -> Tuple[bool, str]:
        """Order the recovery of `plan` and wait (bounded) for every rank's READY."""
        cfg = self.cfg
        self.recovery_id = self.epoch + 1  # the job's count: survivors agree on it
        rid = self.recovery_id
        controller = format_address(*self._address())
        namespace = f"ttp-recovery/{rid}-{secrets.token_hex(8)}"
        with self._cond:
            self._plan, self._ready, self._failed = plan, {}, ""
            self.timeline = {"ordered": time.monotonic()}
            for r in plan.lost:  # a raising (still connected) lost rank: no longer a member
                info = self._ranks.get(r)
                if info is not None and info.status == "alive":
                    self._ranks.set_status(info, "replaced", f"replaced in recovery {rid}")
        if self._namespace is not None:  # the old world's rendezvous can go now
            self._close_store(self._namespace)
        self._namespace = namespace
        log.warning("%s: recovering in memory (recovery %d): iteration %d, replacing %s from "
                    "%s; new world on %s", self.name, rid, plan.step, list(plan.lost),
                    [plan.partners[r] for r in plan.lost], namespace)
        self._out.send_many(list(plan.survivors),
                            P.RecoverOrder(flow_id, rid, plan.step, list(plan.lost), namespace,
                                           cfg.recover_timeout))
        for lost in plan.lost:
            self._out.send(plan.relays[lost],
                           P.ReplaceOrder(rid, flow_id, lost, plan.step, list(plan.lost),
                                          namespace, controller, cfg.recover_timeout,
                                          list(plan.groups[lost])))
        ok, why = self._wait_all_ready(cfg.recover_timeout)
        with self._cond:
            self._plan = None
        if not ok:
            log.error("%s: recovery %d abandoned: %s; the dying checkpoint of iteration %d "
                      "next", self.name, rid, why, plan.step)
            return False, why
        self._out.send_many(list(range(self.world_size)), P.RecoverCommit(rid))
        self._out.flush(2.0)
        self.timeline["committed"] = time.monotonic()
        self._committed = rid
        took = self.timeline["committed"] - self.timeline["ordered"]
        log.warning("%s: recovery %d committed in %.2f s: every rank holds iteration %d, "
                    "checked; training goes on with iteration %d", self.name, rid, took,
                    plan.step, plan.step + 1)
        return True, f"recovered in memory to step {plan.step} in {took:.2f} s"

    def _wait_all_ready(self, timeout: float) -> Tuple[bool, str]:
        deadline = time.monotonic() + timeout
        everyone = set(range(self.world_size))
        with self._cond:
            while True:
                if self._failed:
                    return False, self._failed
                if set(self._ready) >= everyone:
                    return True, ""
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(everyone - set(self._ready))
                    return False, (f"ranks {missing[:16]} not ready within TTP_RECOVER_TIMEOUT="
                                   f"{timeout:g} s")
                self._cond.wait(left)
