"""The dying-checkpoint flow: what a controller does about a fault, in its own thread.

lock (phase 1) -> advance to the newest step (phase 2) -> choose_step -> claim the fault ->
save orders (each with its own namespace of the controller's authenticated store, closed when
the flow ends) -> rename on one rank -> exit orders. Every wait is bounded and O(1) per answer:
the controller's I/O thread tells the flow of each answer (or death) and the flow wakes only
when nobody it waits for is left.

A report is a rank's word, and one rank holding the key (a bug, a compromised host) must not
set what every other rank does: a step reported beyond the agreed step + 1 (`bound_reports`)
is refused, and that rank's state is not used.

A `Flow` is owned by one controller and is given exactly what it uses, so it can run (and be
tested) without one: the controller's condition (`lock`, which guards the roster and the flow's
own answer sets), its state machine (the one place for states), its `Roster`, and an `Outbox`
(four ways to send). The controller's I/O thread calls back into the flow through `fault`,
`joined`, `left`, `report` and `result`, always holding `lock`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Set, Tuple, Union

from mindio_ttp.config import ENV_RECOVERY, Outcome, TTPConfig
from mindio_ttp.control.controller.recovery_coordinator import RecoveryCoordinator
from mindio_ttp.control.controller.recovery_plan import IN_MEMORY, plan_recovery
from mindio_ttp.control.controller.roster import Roster
from mindio_ttp.control.controller.selection import (
    Layout,
    RankState,
    agreed_layout,
    choose_step,
    replacement_savers,
    savers_for,
    states_from,
)
from mindio_ttp.control.controller.state import ControllerState as S
from mindio_ttp.control.controller.state import StateMachine
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import ranksets
from mindio_ttp.faulttime import claim as C
from mindio_ttp.faulttime import save_session
from mindio_ttp.recovery.rank import RECOVERY

log = logging.getLogger("mindio_ttp.controller")

FAILOVER_QUIET_S = 1.0  # see Flow._wait_for_failovers


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    step: Optional[int]
    ranks: List[int]
    reason: str
    seconds: float  # from the first fault to the exit orders


@dataclass(frozen=True)
class Verdict:
    """What a flow that ends the job decided: every rank's exit order says it."""
    outcome: Outcome
    step: Optional[int] = None
    ranks: List[int] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True)
class Recovered:
    """The flow's in-memory recovery committed: the job trains on."""


FlowResult = Union[Verdict, Recovered]


@dataclass(frozen=True)
class SaveAttempt:
    """The last save order of a flow: who it went to, under which flow id, and how it went."""
    savers: List[int]
    flow_id: int
    ok: bool
    why: str


class Outbox(Protocol):
    """How the flow reaches the ranks: the controller's I/O thread does the sending, so none of
    these blocks on a socket (flush waits, bounded, until every queued frame is written)."""

    def broadcast(self, msg: P.Message, exclude: Optional[int] = None) -> None:
        """To every live rank (but `exclude`)."""

    def send_many(self, ranks: List[int], msg: P.Message) -> None:
        """To these ranks, serialised once."""

    def send(self, rank: int, msg: P.Message) -> None:
        """To one rank."""

    def flush(self, timeout: float) -> bool:
        """True once everything queued so far is written."""


class Flow:
    def __init__(self, cfg: TTPConfig, world_size: int, replica: int, host_rank: int, name: str,
                 sm: StateMachine, lock: threading.Condition, roster: Roster, outbox: Outbox,
                 close_store: Callable[[str], None],
                 claims: Callable[[], Optional[C.ClaimSpace]] = lambda: None,
                 address: Optional[Callable[[], Tuple[str, int]]] = None,
                 rearmed: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.world_size, self.replica = cfg, world_size, replica
        self.host_rank, self.name = host_rank, name
        self.sm = sm
        self._cond = lock
        self._ranks = roster
        self._out = outbox
        self._close_store = close_store  # drops a namespace of the controller's store
        self._claims = claims  # where faults are claimed (read at the fault: set after start)
        self.decision: Optional[Decision] = None
        self.decided = threading.Event()
        self.fault_at: Optional[float] = None
        self.timeline: Dict[str, float] = {}  # flow milestones, time.monotonic()
        self.faults: List[str] = []
        self._thread: Optional[threading.Thread] = None
        self._promoted = False
        self._flow_id = 0
        self._reports: Dict[int, Dict[int, Tuple[Optional[int], bool]]] = {1: {}, 2: {}}
        self._results: Dict[int, P.Message] = {}
        self._awaiting: Set[int] = set()  # ranks the flow still waits for (see _await)
        self._await_kind: Tuple[str, int] = ("", 0)
        self._claim: Optional[C.Claim] = None
        self._save_ns: Optional[str] = None  # the store namespace of the current save order
        self._faulty: Dict[int, str] = {}  # ranks whose reports are refused, and why
        self._failed: List[int] = []  # ranks that failed the last order (`_order`)
        # for the in-memory recovery's decision (docs/recovery.md)
        self._raised: Set[int] = set()  # ranks that reported their own exception
        self._preempted = False
        self.known_hosts: Dict[int, str] = {}  # hosts of ranks that never registered here
        self._rearmed = rearmed  # the controller's, after a committed recovery (holding lock)
        self.recovery = RecoveryCoordinator(cfg, world_size, name, lock, roster, outbox,
                                            address or (lambda: ("", 0)), close_store)

    # -- called by the controller's I/O thread, holding `lock` ----------------------------------
    def fault(self, desc: str, promoted: bool = False, rank: Optional[int] = None,
              kind: str = "") -> None:
        """Record a fault; the first one while SERVING starts the flow thread. `promoted`: this
        controller is a standby that just took over, so slower processors may still fail over
        to it before the flow freezes the membership. `rank`/`kind`: a rank's own report (its
        exception, a preemption, a collective that failed under it), for the recovery."""
        self.faults.append(desc)
        if rank is not None and kind == "exception":
            self._raised.add(rank)
        self._preempted = self._preempted or kind == "preempted"
        if self._thread is not None:
            # a survivor's collective that failed on the lost rank is expected, not news
            (log.info if kind == "collective" else log.warning)(
                "%s: further fault during the flow: %s", self.name, desc)
            if self.sm.is_in(S.RECOVERING) and kind != "collective":  # not a casualty's report
                self.recovery.fault(desc)
            return
        if not self.sm.is_in(S.SERVING):
            return
        log.warning("%s: FAULT %s; handling it: %s", self.name, desc,
                    "in-memory recovery if it can work, else the dying checkpoint"
                    if self.cfg.recovery == IN_MEMORY else
                    f"the dying checkpoint ({ENV_RECOVERY}={self.cfg.recovery})")
        self._promoted = promoted
        self.fault_at = time.monotonic()
        self.timeline["fault"] = self.fault_at
        self.sm.transition_to(S.COLLECTING, desc)
        self._thread = threading.Thread(target=self._flow, name="ttp-flow", daemon=True)
        self._thread.start()

    def joined(self, rank: int) -> None:
        """A rank registered (again) mid-flow: the I/O thread sends it the phase orders it
        broadcast so far, and the flow awaits its report."""
        kind, phase = self._await_kind
        if kind == "report" and rank not in self._reports.get(phase, {}):
            self._awaiting.add(rank)

    def left(self, rank: int) -> None:
        """A rank is no longer alive: the flow stops waiting for it."""
        self._awaiting.discard(rank)

    def report(self, flow_id: int, phase: int, rank: int, step: Optional[int],
               updating: bool) -> None:
        if flow_id == self._flow_id and phase in self._reports:
            if rank not in self._faulty:
                self._reports[phase][rank] = (step, updating)
            self._arrived(("report", phase), rank)

    def result(self, flow_id: int, rank: int, msg: P.Message) -> None:
        """A SaveResult or RenameResult."""
        if flow_id == self._flow_id:
            self._results[rank] = msg
            self._arrived(("result", 0), rank)

    # -- the flow thread -----------------------------------------------------------------------
    def _flow(self) -> None:
        result: FlowResult
        try:
            result = self._run_flow()
        except Exception as exc:  # a bug must still end the job, not leave it hanging
            log.exception("%s: flow failed", self.name)
            result = Verdict(Outcome.SAVE_FAILED, reason=f"controller error: {exc!r}")
        if isinstance(result, Recovered):
            self._rearm()
            return
        self._finish(result)

    def _rearm(self) -> None:
        """After a committed recovery: serve again, ready for the next fault."""
        with self._cond:
            self._thread = None
            self._reports = {1: {}, 2: {}}
            self._faulty, self._raised, self._preempted = {}, set(), False
            self.fault_at = None
            self.sm.transition_to(S.SERVING, f"recovery {self.recovery.recovery_id} committed")
            self._rearmed()
            self._cond.notify_all()

    def _wait_for_failovers(self) -> None:
        """A promoted standby waits for the rest of the job to fail over to it: until all but
        one rank are here, or for at least 2 heartbeat intervals (+0.5 s) and then until
        registrations have stopped coming for FAILOVER_QUIET_S: the whole job re-registering
        takes world_size handshakes, seconds at 10k+ ranks, and a rank frozen out of the flow
        counts as dead (both holders of a shard among them: nothing is saved). Bounded by
        TTP_HANDSHAKE_TIMEOUT (scaled with the job) past the floor."""
        floor = self.cfg.deadlines.failover_floor
        t0 = time.monotonic()
        deadline = t0 + self.cfg.deadlines.failover_ceiling
        with self._cond:
            while self._ranks.n_alive < self.world_size - 1:
                now = time.monotonic()
                if now >= deadline or (now - t0 >= floor and
                                       now - self._ranks.changed_at >= FAILOVER_QUIET_S):
                    return
                self._cond.wait(min(deadline - now, 0.25))

    def _await(self, timeout: float) -> List[int]:
        """Block until every rank named by the last `_expect` answered (or died), or timeout;
        returns the ranks still missing. O(1) per answer: the I/O thread shrinks the set and
        only wakes us when it is empty, so 4096 answers cost no quadratic re-scans."""
        deadline = time.monotonic() + timeout
        with self._cond:
            try:
                while self._awaiting:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                return sorted(self._awaiting)
            finally:
                self._awaiting = set()
                self._await_kind = ("", 0)

    def _expect(self, kind: Tuple[str, int], ranks: Iterable[int]) -> None:
        """Declare what the flow waits for: must run before the orders go out."""
        with self._cond:
            self._await_kind = kind
            self._awaiting = {r for r in ranks if self._ranks[r].status == "alive"}

    def _arrived(self, kind: Tuple[str, int], rank: int) -> None:
        if self._await_kind == kind and rank in self._awaiting:
            self._awaiting.discard(rank)
            if not self._awaiting:
                self._cond.notify_all()

    def _alive(self) -> List[int]:
        with self._cond:  # the I/O thread may register a rank meanwhile
            return self._ranks.alive()

    def _run_flow(self) -> FlowResult:
        cfg = self.cfg
        if self._promoted:  # let slower processors fail over before freezing the membership
            self._wait_for_failovers()
        with self._cond:
            self._flow_id += 1
            fid = self._flow_id
            self._reports = {1: {}, 2: {}}
            self._faulty = {}
        # phase 1: freeze (no new update may start) and learn who is where
        self._expect(("report", 1), self._alive())
        self._out.broadcast(P.Lock(fid))
        self._await(cfg.collect_timeout)
        self.timeline["locked"] = time.monotonic()
        with self._cond:
            agreed = self._refuse_beyond(1, None)
            first = dict(self._reports[1])
        limit = max([(s or 0) + (1 if u else 0) for s, u in first.values()] or [0])
        # phase 2: ranks one update behind their partners may catch up to `limit`, then stop
        advance = P.AdvanceTo(fid, limit, cfg.update_grace)
        self._expect(("report", 2), self._alive())
        self._out.broadcast(advance)
        silent = self._await(cfg.deadlines.advance_wait)
        with self._cond:
            for r in silent:
                self._ranks[r].note = "did not answer the collect in time"
            self._refuse_beyond(2, agreed)
            try:
                layout = self._agreed_layout()
            except ValueError as exc:
                return Verdict(Outcome.NO_CONSISTENT_STEP,
                               reason=f"inconsistent DP layout: {exc}")
            reports = dict(self._reports[2])
            notes = {i.rank: i.note for i in self._ranks.values()}
            for r in range(self.world_size):
                notes.setdefault(r, "did not register with this controller (dead or hung)")
        log.info("%s: limit step %d; collected %d state report(s): %s", self.name, limit,
                 len(reports), _summary(reports))
        states = states_from(reports, range(self.world_size), notes)
        recovered, replaced = self._try_recovery(fid, layout, states, reports)
        if recovered:
            return Recovered()
        if replaced:  # a recovery ran and was abandoned
            fid = self._after_abandoned(states, replaced)
        step, reason = choose_step(layout, states, self.world_size)
        if step is None:
            log.error("%s: %s; nothing is saved", self.name, reason)
            return Verdict(Outcome.NO_CONSISTENT_STEP, reason=reason)
        savers = savers_for(layout, states, step)
        self.timeline["chosen"] = time.monotonic()
        # a faulty rank answered too: it is on this controller's side of any partition
        settled, why = self._settle(fid, step, sorted(set(reports) | set(self._faulty)))
        if not settled:
            log.error("%s: not saving step %d: %s", self.name, step, why)
            return Verdict(Outcome.NOT_CLAIMED, reason=why)
        log.info("%s: %s; %s; ordering save on rank(s) %s", self.name, reason, why,
                 ranksets.describe(savers))
        self.sm.transition_to(S.SAVING, f"step {step} on {len(savers)} rank(s)")
        attempt = self._save(fid, step, layout, states, savers)
        savers, fid = attempt.savers, attempt.flow_id
        self.timeline["saved"] = time.monotonic()
        if not attempt.ok:
            return Verdict(Outcome.SAVE_FAILED, step, savers, f"save of iteration {step} failed: "
                           f"{attempt.why}; rename not run, nothing marked latest")
        self.sm.transition_to(S.RENAMING, f"rename on rank {savers[0]}")
        if self._claim is not None:  # durably, before the order: the claim is final from here
            self._claim.update(C.RENAMING, step=step, savers=ranksets.encode(savers))
        ok, why = self._order(savers[:1], P.RenameOrder(fid, step, cfg.rename_time_limit),
                              cfg.rename_time_limit)
        if not ok:
            return Verdict(Outcome.SAVE_FAILED, step, savers,
                           f"rename of iteration {step} failed: {why}; nothing marked latest")
        return Verdict(Outcome.SAVED, step, savers,
                       f"dying checkpoint of iteration {step} saved by {ranksets.describe(savers)}")

    def _save(self, fid: int, step: int, layout: Layout, states: Dict[int, RankState],
              savers: List[int]) -> SaveAttempt:
        """Order the save of `step`; when savers fail or miss their deadline, order it again
        with each failed saver's shard moved to its other clean holder (`replacement_savers`),
        while TTP_OT leaves time for another save and the rename (the new order's limit is
        what is left, at most TTP_SAVE_TIME_LIMIT; less than a quarter of it: no new order).
        Every attempt is a new order: a new flow id (a late answer to an earlier attempt is
        ignored), its own tag, so its own staging directory (a failed attempt's files are never
        part of the checkpoint) and store namespace. Returns the last attempt (a SaveAttempt)."""
        cfg = self.cfg
        failed: Set[int] = set()
        limit = cfg.save_time_limit
        while True:
            # the chosen ranks rendezvous in a namespace of this controller's authenticated
            # store, for this order alone; it is dropped as soon as the order is answered
            tag = save_session.new_tag()
            self._save_ns = save_session.namespace_of(tag)
            order = P.SaveOrder(fid, step, savers, limit, self._save_ns, tag)
            ok, why = self._order(savers, order, limit)
            self._end_save_store("the save order was answered")
            if ok:
                return SaveAttempt(savers, fid, True, why)
            failed.update(self._failed)
            nxt = replacement_savers(layout, states, step, savers, failed, set(self._alive()))
            if nxt is None:
                return SaveAttempt(savers, fid, False,
                                   why + "; no other clean holder can replace them")
            # what TTP_OT leaves for another save, once the rename and the exit orders fit
            spent = time.monotonic() - (self.fault_at or time.monotonic())
            left = cfg.deadlines.save_retry_left(spent)
            if left < cfg.save_time_limit / 4:
                return SaveAttempt(savers, fid, False, (
                    f"{why}; TTP_OT ({cfg.ot:g} s) leaves {max(left, 0):.0f} s, too little to "
                    "order the save again"))
            limit = min(cfg.save_time_limit, left)
            log.warning("%s: save of step %d failed on rank(s) %s (%s); ordering it again, "
                        "from rank(s) %s, within %.1f s", self.name, step, sorted(self._failed),
                        why, nxt, limit)
            with self._cond:
                self._flow_id += 1
                fid = self._flow_id
            savers = nxt

    def _refuse_beyond(self, phase: int, agreed: Optional[int]) -> int:
        """Drop the reports of `phase` that claim a step beyond the agreed step + 1 (caller
        holds the lock); those ranks are faulty for the rest of the flow. Returns the agreed
        step (computed from phase 1's reports when `agreed` is None)."""
        reports = self._reports[phase]
        if agreed is None:
            agreed, beyond = bound_reports(reports)
        else:
            beyond = [r for r, (s, u) in reports.items() if (s or 0) + u > agreed + 1]
        for r in beyond:
            step, updating = reports.pop(r)
            why = (f"reported step {step}{' (updating)' if updating else ''} in phase {phase}, "
                   f"beyond the agreed step {agreed} + 1: a faulty rank, its state is not used")
            self._faulty[r] = why
            log.error("%s: rank %d %s", self.name, r, why)
            info = self._ranks.get(r)
            if info is not None:
                info.note = why
        return agreed

    def _agreed_layout(self) -> Layout:
        """The layout from the DP groups the members agree on (selection.agreed_layout); a
        rank whose registered group its members do not confirm is faulty, its reports dropped
        like a lying step report's (caller holds the lock). ValueError when even the agreed
        groups do not make a layout."""
        layout, dropped = agreed_layout(self._ranks.claims(), self.replica)
        for r, why in sorted(dropped.items()):
            self._faulty[r] = why
            for phase in self._reports.values():
                phase.pop(r, None)
            log.error("%s: rank %d %s", self.name, r, why)
            info = self._ranks.get(r)
            if info is not None:
                info.note = why
        return layout

    def _after_abandoned(self, states: Dict[int, RankState], replaced: Set[int]) -> int:
        """After an abandoned recovery, the states collected before it are stale: a survivor
        may have died, hung or raised during it, and a dead one picked as a saver holds the
        save until its limit, then nothing is saved. Every rank that faulted meanwhile, or does
        not answer a fresh lock now (a death the I/O thread has not yet seen, a hang its
        heartbeat timeout has not yet caught), is no holder; so are the ranks the recovery
        replaced (their processes are gone). Returns the new flow id. Updates `states`."""
        with self._cond:
            self._flow_id += 1
            fid = self._flow_id
            self._reports[1] = {}
        self._expect(("report", 1), self._alive())
        self._out.broadcast(P.Lock(fid))
        self._await(self.cfg.collect_timeout)
        with self._cond:
            answered = set(self._reports[1])
            raised = self._raised | set(self._faulty)
            notes = {i.rank: (i.status, i.note) for i in self._ranks.values()}
        dropped = []
        for r in sorted(states):
            if not states[r].alive:
                continue
            status, note = notes.get(r, ("unknown", ""))
            if r in replaced:
                why = "replaced by the abandoned recovery"
            elif r in raised:
                why = "faulted during the abandoned recovery"
            elif status != "alive":
                why = f"{note or status} during the abandoned recovery"
            elif r not in answered:
                why = "did not answer the lock after the abandoned recovery"
            else:
                continue
            states[r] = RankState(False, None, False, why)
            if r not in replaced:
                dropped.append(r)
        if dropped:
            log.warning("%s: rank(s) %s lost during the abandoned recovery: not holders",
                        self.name, ranksets.describe(dropped))
        return fid

    def _end_save_store(self, why: str) -> None:
        if self._save_ns is not None:
            self._close_store(self._save_ns)
            log.info("%s: store namespace %s closed: %s", self.name, self._save_ns, why)
            self._save_ns = None

    def _try_recovery(self, fid: int, layout: Layout, states: Dict[int, RankState],
                      reports: Dict[int, Tuple[Optional[int], bool]]) -> Tuple[bool, Set[int]]:
        """In-memory recovery when it can work (control/controller/recovery_plan.py): (committed,
        ranks it
        replaced). Not committed: the dying checkpoint (also after an abandoned recovery)."""
        with self._cond:
            lost = ({r for r in range(self.world_size) if r not in reports} | self._raised
                    | set(self._faulty))
            hosts = {**self.known_hosts, **{i.rank: i.host for i in self._ranks.values()}}
        capable = RECOVERY.capability()
        if capable[0] and not self.cfg.replacements:
            capable = (False, "the launcher does not start replacements (ttprun does)")
        claimed = False
        if capable[0] and self.cfg.recovery == IN_MEMORY and 2 * len(lost) == self.world_size:
            claimed = self._claim_half(fid, sorted(set(range(self.world_size)) - lost))
        plan, why = plan_recovery(mode=self.cfg.recovery, capable=capable,
                                  preempted=self._preempted, world_size=self.world_size,
                                  layout=layout, states=states, lost=lost, hosts=hosts,
                                  node_takeover="node" in self.cfg.replacements.split(","),
                                  claimed=claimed)
        if plan is None:
            log.info("%s: no in-memory recovery (%s): the dying checkpoint", self.name, why)
            return False, set()
        self.sm.transition_to(S.RECOVERING, why)
        self.timeline["recovering"] = time.monotonic()
        ok, why = self.recovery.run(fid, plan)
        self.timeline["recovered" if ok else "recovery_abandoned"] = time.monotonic()
        if ok and self._claim is not None:
            try:
                self._claim.update(C.DONE, outcome="recovered", reason=why[:500])
            except OSError as exc:
                log.warning("%s: cannot record the recovery in the claim: %s", self.name, exc)
            self._claim = None
        if not ok:
            log.error("%s: falling back to the dying checkpoint of iteration %d: %s",
                      self.name, plan.step, why)
        return ok, set(plan.lost)

    def _claim_space(self) -> Optional[C.ClaimSpace]:
        """This fault's claim: the launch's fault id, and after in-memory recoveries (the same
        launch goes on, so a later fault needs a claim of its own) one derived from it and
        their count, which both halves of a split job share. ValueError as `_claims`."""
        space = self._claims()
        epoch = self.recovery.epoch
        if space is not None and epoch:
            derived = hashlib.sha256(f"{space.fault_id}:{epoch}".encode()).hexdigest()
            space = C.ClaimSpace(space.directory, derived[:32])
        return space

    def _claim_half(self, fid: int, survivors: List[int]) -> bool:
        """Exactly half the ranks survive: a split job's other half may be running. Only the
        half that wins this fault's claim may recover (the claim is the one decision both
        halves see); the other one's dying checkpoint is then refused by the same claim."""
        try:
            space = self._claim_space()
        except ValueError as exc:
            log.warning("%s: half the ranks survive and the fault cannot be claimed: %s",
                        self.name, exc)
            return False
        if space is None:
            return False
        won, why = C.acquire(space, self.name, flow=fid, ranks=survivors[:64],
                             answered=len(survivors), world_size=self.world_size,
                             purpose="in-memory recovery")
        log.info("%s: half the ranks survive: %s", self.name, why)
        self._claim = won
        return won is not None

    def _settle(self, fid: int, step: int, members: List[int]) -> Tuple[bool, str]:
        """May this flow order a save? With a claim directory, only if it wins this fault's
        claim (whatever its size: a split job's halves cannot count each other, the claim file
        is the one decision both see). Without one, only with a strict majority of the world
        answering: two disjoint parts cannot both have one."""
        if self._claim is not None:  # won for a recovery that was abandoned
            return True, f"this flow holds fault claim {self._claim.space.path}"
        try:
            space = self._claim_space()
        except ValueError as exc:  # a claim directory, but no valid fault id to claim under
            return False, f"cannot claim the fault: {exc}; this part of the job saves nothing"
        if space is None:
            if 2 * len(members) > self.world_size:
                return True, f"{len(members)} of {self.world_size} ranks answered (a majority)"
            return False, (f"only {len(members)} of {self.world_size} ranks answered and no "
                           "checkpoint directory is registered for the fault claim "
                           "(ttp_set_checkpoint_dir): the part of the job this controller "
                           "cannot reach may be saving, so this part saves nothing")
        won, why = C.acquire(space, self.name, flow=fid, step=step, ranks=members[:64],
                             answered=len(members), world_size=self.world_size)
        if won is None:
            return False, f"{why}; this part of the job saves nothing"
        self._claim = won
        return True, why

    def _order(self, ranks: List[int], msg: P.Message, limit: float) -> Tuple[bool, str]:
        with self._cond:
            self._results.clear()
            self._expect(("result", 0), ranks)
        t0 = time.monotonic()
        self._out.send_many(ranks, msg)
        self._await(self.cfg.deadlines.order_wait(limit))
        errors, self._failed = [], []
        with self._cond:
            for r in ranks:
                res = self._results.get(r)
                if res is None:
                    errors.append(f"rank {r}: no result ({self._ranks[r].note or 'timed out'})")
                elif not res.ok:  # type: ignore[attr-defined]
                    errors.append(f"rank {r}: {res.error}")  # type: ignore[attr-defined]
                else:
                    continue
                self._failed.append(r)
        log.info("%s: %s on %d rank(s) done in %.3f s%s", self.name, type(msg).__name__,
                 len(ranks), time.monotonic() - t0, f" with errors: {errors}" if errors else "")
        return not errors, "; ".join(errors)

    def _finish(self, verdict: Verdict) -> None:
        outcome, step, ranks, reason = (verdict.outcome, verdict.step, verdict.ranks,
                                        verdict.reason)
        took = time.monotonic() - (self.fault_at or time.monotonic())
        self.decision = Decision(outcome, step, ranks, reason, took)
        (log.info if outcome is Outcome.SAVED else log.error)(
            "%s: outcome %s (exit code %d): %s", self.name, outcome.value, outcome.exit_code,
            reason)
        self.sm.transition_to(S.EXITING, outcome.value)
        if self._claim is not None:
            try:
                self._claim.update(C.DONE if self._claim.record.get("state") == C.RENAMING
                                   or outcome is Outcome.SAVED else C.CLAIMED,
                                   outcome=outcome.value, reason=reason[:500])
            except OSError as exc:  # the outcome is recorded for people only
                log.warning("%s: cannot record the outcome in the claim: %s", self.name, exc)
        self._end_save_store("the flow ended")
        order = P.ExitOrder(self._flow_id, outcome.value, step, ranks, outcome.exit_code,
                            reason[:P.MAX_TEXT])
        # our own process exits on its order: every other rank must have its order first
        self._out.broadcast(order, exclude=self.host_rank)
        # every other rank's order written before our own process may exit on its own: at
        # 100k ranks that is seconds, so as long as a storm's handshakes may take (scaled)
        self._out.flush(self.cfg.deadlines.exit_flush)
        self.timeline["exit_sent"] = time.monotonic()
        self.decided.set()
        self._out.send(self.host_rank, order)


def bound_reports(reports: Dict[int, Tuple[Optional[int], bool]]) -> Tuple[int, List[int]]:
    """(agreed step, ranks whose report goes beyond it + 1).

    The agreed step is the newest step that at least half of the answering ranks completed (the
    lower median of their reports). With the guide's barrier before every update, no rank can
    be in the update of step k + 1, or past it, before every rank has completed k, so an honest
    report never exceeds the smallest completed step + 1; the median is at least that smallest
    step while faulty ranks are fewer than half, so no honest rank is refused, and one rank that
    reports 10^15 no longer sets every rank's AdvanceTo limit to 10^15 + 1."""
    done = sorted((s or 0) for s, _ in reports.values())
    if not done:
        return 0, []
    agreed = done[(len(done) - 1) // 2]
    return agreed, sorted(r for r, (s, u) in reports.items() if (s or 0) + u > agreed + 1)


def _summary(reports: Dict[int, Tuple[Optional[int], bool]]) -> str:
    items = sorted(reports.items())
    text = ", ".join(f"{r}:{s}{'*' if u else ''}" for r, (s, u) in items[:16])
    return text + (f" ... (+{len(items) - 16})" if len(items) > 16 else "") + " (*: updating)"
