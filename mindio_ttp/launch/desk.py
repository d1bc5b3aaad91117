"""What a rank's processor asks of its node's launcher (ttprun), through TTP_RUN_DIR: start a
replacement for a lost rank (the recovery's relay: replace.py's request and status files),
record a committed recovery (outcome.py) and record the flow's decision on the way out
(flow_record.py). The processor is handed a `LauncherDesk` by the API
face when it starts (framework_ttp): the control plane does not import the launcher."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

from mindio_ttp.config import ENV_RECOVERY_JOIN, Outcome
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.launch import replace as R
from mindio_ttp.launch.flow_record import FlowRecord, write_flow_record
from mindio_ttp.launch.outcome import write_recovered
from mindio_ttp.recovery.rank import RECOVERY, REPLACEMENT, RecoveryOrder

log = logging.getLogger("mindio_ttp.processor")


class LauncherDesk:
    def __init__(self, run_dir: Optional[str], rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank

    def recovered(self, recovery_id: int, step: int, lost: Tuple[int, ...]) -> None:
        write_recovered(self.run_dir, recovery_id, step, lost)

    def exiting(self, outcome: Outcome, step: Optional[int], ranks: Sequence[int], code: int,
                reason: str, checkpoint: Optional[str], latest: Optional[int]) -> None:
        """This rank obeys an exit order (or gives up): flow-finished.json for its launcher.
        Never raises (the way out)."""
        if self.run_dir:
            write_flow_record(self.run_dir, FlowRecord(outcome, step, tuple(ranks), code, reason,
                                                       self.rank, time.time(), checkpoint,
                                                       latest))

    def relay_replacement(self, m: P.ReplaceOrder, send: Callable[[P.Message], None],
                          stop: threading.Event) -> None:
        """Ask this host's launcher for a replacement of rank `m.rank`, and forward what it
        answers (`send`, from any thread: the processor's mailbox) until the recovery ends."""
        order = RecoveryOrder(m.recovery_id, m.flow_id, m.step, tuple(m.lost), m.rendezvous,
                              m.controller, m.deadline, REPLACEMENT, tuple(m.dp_ranks))
        env = {ENV_RECOVERY_JOIN: order.to_env(m.rank)}
        run_dir = self.run_dir
        if not run_dir:
            send(P.ReplaceStatus(m.recovery_id, m.rank, R.FAILED, 0,
                                 "no launcher here (TTP_RUN_DIR unset: not under ttprun)"))
            return
        try:
            R.write_request(run_dir, R.ReplacementRequest(m.recovery_id, m.rank, env))
        except OSError as exc:
            send(P.ReplaceStatus(m.recovery_id, m.rank, R.FAILED, 0,
                                 f"cannot write the request into {run_dir}: {exc}"))
            return
        log.warning("rank %d: asked the launcher for a replacement of rank %d (recovery %d)",
                    self.rank, m.rank, m.recovery_id)

        def watch() -> None:
            deadline = time.monotonic() + m.deadline
            seen = None
            while time.monotonic() < deadline and not stop.is_set():
                status = R.read_status(run_dir, m.recovery_id, m.rank)
                if status is not None and status.state != seen:
                    seen = status.state
                    send(P.ReplaceStatus(m.recovery_id, m.rank, status.state, status.pid,
                                         status.detail))
                if seen in (R.EXITED, R.FAILED) or (seen == R.STARTED and not RECOVERY.active
                                                    and RECOVERY.epoch >= m.recovery_id):
                    return
                stop.wait(0.05)
        threading.Thread(target=watch, name="ttp-replace-watch", daemon=True).start()
