"""Deterministic fault plans keyed by (rank, step, phase).

A training loop calls ``plan.check(rank, step, phase)`` at fixed points; the plan fires the fault
registered for exactly that key and nothing else, so a test knows in advance which step the dying
checkpoint must hold. Plans travel to worker processes as a short text
(``"1:5:sigkill:inside,3:4:exception:save"``) via a command-line flag or env variable.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union


class Fault(str, enum.Enum):
    """What happens to the rank: it dies, throws, or hangs (stopped, so heartbeats stop too);
    or PREEMPT_ALL: SIGTERM to every process of this node's job at once (the launcher, every
    rank, their DataLoader workers), as Slurm signals a job step. SIGKILL_GROUP: SIGKILL to
    the rank's whole process group at once, which for rank 0 includes the controller process
    it started (control/controller/host.py): node 0's loss, as far as the controller is
    concerned."""

    SIGKILL = "sigkill"
    SIGKILL_GROUP = "sigkill-group"
    EXCEPTION = "exception"
    SIGSTOP = "sigstop"
    PREEMPT_ALL = "preempt_all"


class Phase(str, enum.Enum):
    """Where in step ``k`` the fault fires.

    BEFORE: after forward/backward, before the gradient exchange (survivors last finished k-1).
    BARRIER: right after the guide's barrier of step k, before ``ttp_start_updating_os``: with
    EXCEPTION, what a rank sees when the barrier fails for it while its partners passed it.
    Given a record directory, it fires only once every other rank has finished its update of
    step k (each rank marks that at AFTER), so the scenario is the same on every run: the
    others hold step k and only the catch-up (``ttp_offer_update``) gives this rank k too.
    INSIDE: inside the update window, after this rank's shard is updated but before
    ``ttp_end_updating_os(k)`` (the replica partner finishes k).
    AFTER: right after ``ttp_end_updating_os(k)``, before the parameter all-gather (k); beside
    a BARRIER fault of step k (and a record directory) it waits for the same marks.
    SAVE: inside the save handler while writing the checkpoint of step ``k``.
    ANYTIME: at a random instant from the start of step ``k``, up to the length of step k-1
    (a timer thread armed by the injector; where it lands is the point of the fault).
    EVAL: in the first forward step of the evaluation after step ``k``.
    PERIODIC_SAVE: inside Megatron's periodic save of step ``k``, after this rank wrote its
    first file.
    REFILL: on a rank of an in-memory recovery to step ``k``, as it starts refilling
    (docs/recovery.md): a second fault during a recovery.
    REPLACEMENT: in the process started to replace rank ``rank`` in a recovery to step ``k``,
    before it imports anything: a replacement that dies (SIGKILL) or hangs (SIGSTOP).
    The windows of a Megatron job outside its training loop (docs/recovery.md), where ``k``
    is 1 before the first step (STARTUP, MODEL, LOAD) and the last iteration after it:
    STARTUP: once Megatron's start-up (``initialize_megatron``) returned, before the model;
    MODEL: once ``get_model`` built the model, before the optimizer;
    LOAD: as the checkpoint load starts (not a recovery's refill);
    FINAL_EVAL: in the first forward step of the evaluation pretrain runs after train();
    FINAL_SAVE: inside pretrain's final save, once this rank wrote its first file;
    EXIT: right after pretrain's final save completed on every rank (the test evaluation and
    the process exit follow).
    LOG: as Megatron's ``training_log`` of step ``k`` starts, after the step's update, before
    its scalars and the barrier before its printed line.
    """

    BEFORE = "before"
    BARRIER = "barrier"
    INSIDE = "inside"
    AFTER = "after"
    SAVE = "save"
    ANYTIME = "anytime"
    EVAL = "eval"
    PERIODIC_SAVE = "periodic-save"
    REFILL = "refill"
    REPLACEMENT = "replacement"
    STARTUP = "startup"
    MODEL = "model"
    LOAD = "load"
    FINAL_EVAL = "final-eval"
    FINAL_SAVE = "final-save"
    EXIT = "exit"
    LOG = "log"


class InjectedFault(RuntimeError):
    """The exception a ``Fault.EXCEPTION`` raises; its message names rank, step and phase."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    step: int
    fault: Fault
    phase: Phase

    def describe(self) -> str:
        where = {
            Phase.BEFORE: "before the update of",
            Phase.BARRIER: "right after the barrier of",
            Phase.INSIDE: "inside the update window of",
            Phase.AFTER: "after the update of",
            Phase.SAVE: "while saving the checkpoint of",
            Phase.ANYTIME: "at a random instant of",
            Phase.EVAL: "during the evaluation after",
            Phase.PERIODIC_SAVE: "during the periodic save of",
            Phase.REFILL: "while refilling in the recovery to",
            Phase.REPLACEMENT: "as the replacement starts in the recovery to",
            Phase.STARTUP: "after Megatron's start-up, before",
            Phase.MODEL: "after the model is built, before",
            Phase.LOAD: "in the checkpoint load, before",
            Phase.FINAL_EVAL: "during the final evaluation after",
            Phase.FINAL_SAVE: "during the final save of",
            Phase.EXIT: "after the final save (complete everywhere) of",
            Phase.LOG: "as the logging starts of",
        }[self.phase]
        return f"{self.fault.name} rank {self.rank} {where} step {self.step}"


class FaultPlan:
    """An immutable-by-convention registry of faults; ``fail_at`` chains."""

    def __init__(self) -> None:
        self._faults: Dict[Tuple[int, int, Phase], FaultSpec] = {}

    def fail_at(
        self,
        rank: int,
        step: int,
        fault: Union[Fault, str] = Fault.SIGKILL,
        phase: Union[Phase, str] = Phase.INSIDE,
    ) -> FaultPlan:
        if rank < 0 or step < 1:
            raise ValueError(f"fault at rank {rank}, step {step}: rank must be >= 0, step >= 1")
        spec = FaultSpec(rank, step, Fault(fault), Phase(phase))
        key = (rank, step, spec.phase)
        if key in self._faults:
            raise ValueError(
                f"two faults registered at rank {rank}, step {step}, phase {spec.phase.value}"
            )
        self._faults[key] = spec
        return self

    @property
    def faults(self) -> Tuple[FaultSpec, ...]:
        return tuple(sorted(self._faults.values(), key=lambda f: (f.step, f.rank, f.phase.value)))

    def has(self, rank: int, step: int, phase: Phase) -> bool:
        return (rank, step, phase) in self._faults

    def __bool__(self) -> bool:
        return bool(self._faults)

    def describe(self) -> str:
        return "; ".join(f.describe() for f in self.faults) or "no fault"

    # -- text form ---------------------------------------------------------------------------
    def to_text(self) -> str:
        return ",".join(f"{f.rank}:{f.step}:{f.fault.value}:{f.phase.value}" for f in self.faults)

    @classmethod
    def from_text(cls, text: str) -> FaultPlan:
        plan = cls()
        for item in filter(None, (part.strip() for part in text.split(","))):
            fields = item.split(":")
            if len(fields) != 4:
                raise ValueError(
                    f"fault {item!r}: expected rank:step:fault:phase, e.g. 1:5:sigkill:inside"
                )
            rank, step, fault, phase = fields
            try:
                plan.fail_at(int(rank), int(step), Fault(fault), Phase(phase))
            except ValueError as exc:
                raise ValueError(
                    f"fault {item!r}: {exc} (faults: {[f.value for f in Fault]}, "
                    f"phases: {[p.value for p in Phase]})"
                ) from None
        return plan

    # -- firing ------------------------------------------------------------------------------
    def check(self, rank: int, step: int, phase: Phase, record_dir: Optional[Path] = None) -> None:
        """Fire the fault registered at (rank, step, phase), if any; otherwise return at once.

        Before firing it writes ``fault-<rank>.json`` (wall time) into ``record_dir`` so a
        benchmark or the demo can time detection and the flow from the moment of the fault.
        """
        if record_dir is not None and phase is Phase.AFTER and self._barrier_fault(step):
            _mark(record_dir, f"updated-{step}-{rank}")
        spec = self._faults.get((rank, step, phase))
        if spec is None:
            return
        if record_dir is not None and (spec.phase is Phase.BARRIER or (
                spec.phase is Phase.AFTER and self._barrier_fault(step))):
            # a fault after the update, beside a barrier fault of the same step, waits too: a
            # rank out of the barrier first may update and die while a slower one is still
            # inside it, which then fails there instead of updating (a different scenario)
            self._wait_for_the_others(rank, step, record_dir)
        print(f"rank {rank} | FAULT: {spec.describe()}", flush=True)
        if record_dir is not None:
            record = {"rank": rank, "step": step, "fault": spec.fault.value,
                      "phase": spec.phase.value, "time": time.time()}  # fmt: skip
            tmp = record_dir / f".fault-{rank}.json.tmp"
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, record_dir / f"fault-{rank}.json")
        sys.stdout.flush()
        sys.stderr.flush()
        together = [
            f.rank for f in self.faults if (f.step, f.phase, f.fault) == (step, phase, spec.fault)
        ]
        if spec.fault is Fault.SIGKILL and len(together) > 1 and record_dir is not None:
            _kill_together(rank, step, phase, together, record_dir)
        if spec.fault is Fault.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.fault is Fault.SIGKILL_GROUP:
            _kill_own_group()
        elif spec.fault is Fault.SIGSTOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.fault is Fault.PREEMPT_ALL:
            _signal_the_whole_job(signal.SIGTERM)
        else:
            raise InjectedFault(f"injected fault: {spec.describe()}")


    def _barrier_fault(self, step: int) -> bool:
        return any(f.step == step and f.phase is Phase.BARRIER for f in self._faults.values())

    def _wait_for_the_others(self, rank: int, step: int, record_dir: Path) -> None:
        """Until every rank without a barrier fault of this step has marked its update of
        `step` done (a polled deadline; the ranks are separate processes)."""
        world = int(os.environ.get("WORLD_SIZE", "0"))
        others = [r for r in range(world) if not self.has(r, step, Phase.BARRIER)]
        deadline = time.monotonic() + BARRIER_WAIT_S
        while not all((record_dir / f"updated-{step}-{r}").exists() for r in others):
            if time.monotonic() > deadline:
                print(f"rank {rank} | fault plan: ranks {others} did not all finish the update of "
                      f"step {step} within {BARRIER_WAIT_S:.0f} s; firing anyway", flush=True)
                return
            time.sleep(0.005)


BARRIER_WAIT_S = 120.0


def _mark(record_dir: Path, name: str) -> None:
    tmp = record_dir / f".{name}.tmp"
    tmp.write_text(str(time.time()), encoding="utf-8")
    os.replace(tmp, record_dir / name)


def _kill_own_group() -> None:
    """SIGKILL to this rank's process group, itself included, in one call. Only when this
    process leads its group (a launcher starts each worker in a session of its own): the group
    of a process that does not lead it is its launcher's, which the plan must not kill."""
    group = os.getpgid(0)
    if group != os.getpid():
        raise InjectedFault(f"fault plan: {Fault.SIGKILL_GROUP.value} needs a rank that leads "
                            f"its process group (this one is in group {group}, not its own): "
                            "start the ranks with ttprun or torchrun")
    os.killpg(group, signal.SIGKILL)


def _signal_the_whole_job(sig: int) -> None:
    """`sig` to the launcher that started this rank and to all its descendants, each once, as
    close to the same instant as a loop allows (this rank last, so it sends them all)."""
    import psutil

    launcher = psutil.Process(os.getppid())
    targets = [launcher, *launcher.children(recursive=True)]
    for proc in targets:
        if proc.pid != os.getpid():
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    os.kill(os.getpid(), sig)


def _kill_together(rank: int, step: int, phase: Phase, ranks: list, record_dir: Path) -> None:
    """Kill several ranks at the same instant, so the controller never sees one dead and the
    other still answering (that would make "two ranks killed together" a race).

    Each rank announces its pid and stops itself; the last to arrive kills all the others
    (stopped processes keep their sockets open, so nothing is detected until then) and returns,
    after which the caller kills itself.
    """
    tag = f"together-{step}-{phase.value}"
    mine = record_dir / f"{tag}-{rank}.pid"
    tmp = record_dir / f".{tag}-{rank}.tmp"
    tmp.write_text(str(os.getpid()), encoding="utf-8")
    os.replace(tmp, mine)
    armed = {r: record_dir / f"{tag}-{r}.pid" for r in ranks}
    if not all(p.exists() for p in armed.values()):
        os.kill(os.getpid(), signal.SIGSTOP)  # the last rank to arrive kills us
        return
    for other, path in armed.items():
        if other != rank:
            try:
                os.kill(int(path.read_text(encoding="utf-8")), signal.SIGKILL)
            except ProcessLookupError:
                pass
