"""This process's side of an in-memory recovery: the order it follows and how it reports.

Framework-agnostic (no torch, no Megatron): the processor's thread hands orders in
(`ordered`, `commit`, `abandon`), the training thread, inside the patched Megatron start-up
(`mindio_ttp.megatron_ttp.rejoin`), moves the state machine along and reports through
`report_ready`, which the processor turns into a `RecoverReady` frame. A replacement process
learns its order from its environment (`TTP_RECOVERY_JOIN`, written by the launcher).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Optional, Tuple

from mindio_ttp.config import ENV_RECOVERY_JOIN
from mindio_ttp.recovery.machine import RecoveryMachine
from mindio_ttp.recovery.machine import RecoveryState as S

log = logging.getLogger("mindio_ttp.recovery")

ENV_JOIN = ENV_RECOVERY_JOIN  # set by the launcher in a replacement's environment
SURVIVOR, REPLACEMENT = "survivor", "replacement"


@dataclass(frozen=True)
class RecoveryOrder:
    """What one recovery asks of this rank. `store` is the namespace of the authenticated store
    the new world rendezvous on; `controller` the acting controller's "host:port", where a
    replacement registers, with `dp_ranks` (its DP group); `deadline_s` how long the
    controller waits for every rank's READY."""

    recovery_id: int
    flow_id: int
    step: int
    lost: Tuple[int, ...]
    store: str
    controller: str
    deadline_s: float
    role: str = SURVIVOR
    dp_ranks: Tuple[int, ...] = ()

    def to_env(self, rank: int) -> str:
        return json.dumps({**asdict(self), "lost": list(self.lost), "role": REPLACEMENT,
                           "dp_ranks": list(self.dp_ranks), "rank": rank}, sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> Tuple[RecoveryOrder, int]:
        """The order and the rank a replacement was started for; ValueError if malformed."""
        try:
            obj = json.loads(text)
            order = cls(int(obj["recovery_id"]), int(obj["flow_id"]), int(obj["step"]),
                        tuple(int(r) for r in obj["lost"]), str(obj["store"]),
                        str(obj["controller"]), float(obj["deadline_s"]), REPLACEMENT,
                        tuple(int(r) for r in obj["dp_ranks"]))
            rank = int(obj["rank"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{ENV_JOIN} is not a recovery order ({exc}): {text[:200]!r}") \
                from None
        if rank not in order.lost or rank not in order.dp_ranks or order.step < 1:
            raise ValueError(f"{ENV_JOIN}: rank {rank} is not among the lost ranks "
                             f"{list(order.lost)} or its DP group {list(order.dp_ranks)}, or "
                             f"step {order.step} < 1")
        return order, rank


class RecoveryRefused(RuntimeError):
    """A verdict every rank of the recovery reaches alike (copies that differ after the refill,
    a recovery abandoned or never committed): not this rank's own fault, so its state still
    serves the fallback's save."""


Capability = Callable[[], Tuple[bool, str]]
NO_HOOKS = (False, "this process has no in-memory recovery hooks (the training code is not "
                   "patched for it: `ttp-patch apply` adds them)")


class RankRecovery:
    """The recovery state of this process (one per process: `RECOVERY`)."""

    def __init__(self) -> None:
        self.machine = RecoveryMachine()
        self.order: Optional[RecoveryOrder] = None
        self.epoch = 0  # recoveries committed in this process's job (a replacement: its order's)
        self.capability: Capability = lambda: NO_HOOKS
        # set by the processor: sends RecoverReady(recovery_id, ok, detail, digest, seconds)
        self.reporter: Optional[Callable[[int, bool, str, str, float], None]] = None
        self._cond = threading.Condition()
        self._committed: Optional[int] = None
        self._abandoned = ""
        self._started = 0.0

    # -- from the processor's thread -------------------------------------------------------------
    def ordered(self, order: RecoveryOrder) -> bool:
        """A survivor got its order; False (logged) when one is already under way."""
        with self._cond:
            if self.machine.state is not S.IDLE:
                log.error("recovery %d ordered while this rank is %s: ignored",
                          order.recovery_id, self.machine.state.value)
                return False
            self.order, self._committed, self._abandoned = order, None, ""
            self._started = time.monotonic()
            self.machine.transition_to(S.ORDERED, f"recovery {order.recovery_id} to step "
                                       f"{order.step}, lost {list(order.lost)}")
            self._cond.notify_all()
        return True

    def commit(self, recovery_id: int) -> None:
        with self._cond:
            if self.order is None or self.order.recovery_id != recovery_id:
                log.warning("commit of recovery %d, which this rank does not run", recovery_id)
                return
            self._committed = recovery_id
            self._cond.notify_all()

    def abandon(self, why: str) -> None:
        with self._cond:
            if self.machine.abandon(why):
                self._abandoned = why
            self._cond.notify_all()

    # -- from the training thread ----------------------------------------------------------------
    def joining(self, order: RecoveryOrder) -> None:
        """This process is a replacement: it starts its life inside the recovery."""
        with self._cond:
            self.order, self._committed, self._abandoned = order, None, ""
            self._started = time.monotonic()
            self.epoch = order.recovery_id - 1
            self.machine.transition_to(S.JOINING, f"replacement in recovery {order.recovery_id}"
                                       f" to step {order.step}")

    @property
    def pending(self) -> bool:
        """A survivor's order arrived and its training thread has not left the step yet."""
        return self.machine.state is S.ORDERED

    @property
    def active(self) -> bool:
        return self.machine.active

    @property
    def abandoned(self) -> bool:
        return self.machine.state is S.ABANDONED

    def report_ready(self, ok: bool, detail: str = "", digest: str = "") -> None:
        """Tell the controller this rank holds the recovery's step, checked (or why not)."""
        order = self.order
        if order is None or self.reporter is None:
            log.error("cannot report recovery readiness: %s", "no order" if order is None
                      else "no processor")
            return
        self.reporter(order.recovery_id, ok, detail[:2000], digest,
                      time.monotonic() - self._started)

    def wait_commit(self, timeout: float) -> Tuple[bool, str]:
        """Block until the controller commits the recovery (True) or gives it up (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                order = self.order
                if order is not None and self._committed == order.recovery_id:
                    self.machine.transition_to(S.IDLE, f"recovery {order.recovery_id} "
                                               "committed")
                    self.epoch = order.recovery_id
                    return True, ""
                if self.machine.state is S.ABANDONED:
                    return False, self._abandoned or "abandoned"
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, f"no commit within {timeout:g} s"
                self._cond.wait(left)


RECOVERY = RankRecovery()


def join_order(environ: Mapping[str, str] = os.environ) -> Optional[Tuple[RecoveryOrder, int]]:
    """(order, rank) when this process was started as a replacement, else None."""
    text = environ.get(ENV_JOIN)
    return RecoveryOrder.from_env(text) if text else None


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> Tuple[str, int]:
    """"host:port" or "[v6]:port"; ValueError with what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store address {text[:80]!r} is not host:port")
    return host.strip("[]"), int(port)
