"""The controller in a process of its own, started by rank 0's `ttp_start_controller`.

The guide starts the controller on rank 0, and rank 0 trains: a controller thread there shares
its GIL with Megatron's Python-driven step, and every rank waits for rank 0 at each collective,
so each microsecond the controller spends on a heartbeat is taken from the whole job. At
16,384 ranks that is ~8,000 heartbeats a second (docs/benchmarks.md#controller-scale). So
`ttp_start_controller` starts this module as a child process (a fresh interpreter: forking a
training process would copy its communicator sockets and device state) and returns once the
child is listening; the API and the patched code stay the same. The child has its own GIL and
can be scheduled on any free core of node 0.

A plus of the separate process: it outlives rank 0. A rank 0 that dies (SIGKILL, OOM, a crash)
is just a dead rank to a controller that keeps running, so the flow starts at once without a
failover; only the loss of node 0 itself (both processes) makes the processors fail over to a
standby, as before. The child ignores SIGINT and SIGTERM (a Ctrl-C or a preemption signal sent
to rank 0's process group is the ranks' to report, and the flow needs the controller), stays in
rank 0's process group so a launcher's kill of that group still ends it, and ends by itself:
after the exit orders of a flow, on `stop` from rank 0 (normal end of training), or once rank
0's process is gone and no rank is connected any more (after an in-memory recovery replaced
rank 0, it stays the job's controller for the rest of training).

Rank 0 and its controller talk over a socketpair, one JSON object per line: the start
parameters, `listening` (or `error`), the fault-claim directory when it is registered later,
`stop`, and for tools and tests `status` (the controller's state, registered ranks, faults) and
the `flow` report the child sends when a flow has decided. Nothing secret crosses it: the
child reads TTP_AUTH_KEY(_FILE) from the environment it inherits, like any rank.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from mindio_ttp.config import Deadlines, TTPConfig
from mindio_ttp.faulttime import claim as C
from mindio_ttp.hooks import TTPError
from mindio_ttp.log import setup_logging
from mindio_ttp.recovery.rank import NO_HOOKS, RECOVERY

log = logging.getLogger("mindio_ttp.controller")

START_TIMEOUT_S = 60.0  # interpreter start and imports on a busy node, then the bind
POLL_S = 0.2


class _Channel:
    """JSON lines over one end of the socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def send(self, **obj: Any) -> None:
        try:
            self.sock.sendall(json.dumps(obj).encode() + b"\n")
        except OSError:
            pass  # the other side is gone; the caller finds out on its next read

    def recv(self, timeout: float) -> Optional[List[Dict[str, Any]]]:
        """The messages that arrive within `timeout` ([] for none); None once the peer is gone."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return []
        except OSError:
            return None
        if not data:
            return None
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line]


class ControllerProcess:
    """Rank 0's handle on the controller process: what the API keeps in place of a Controller."""

    def __init__(self, cfg: TTPConfig, world_size: int, replica: int, host_rank: int) -> None:
        self.cfg, self.world_size, self.replica = cfg, world_size, replica
        self.host_rank = host_rank
        self.address: Optional[Tuple[str, int]] = None
        self.proc: Optional[subprocess.Popen] = None
        self._chan: Optional[_Channel] = None
        self._inbox: List[Dict[str, Any]] = []  # reports read while waiting for another

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def start(self, ip: str, port: int, claims: Optional[Path] = None,
              capable: Tuple[bool, str] = NO_HOOKS) -> Tuple[str, int]:
        """Start the child and return once it listens on ip:port; TTPError (the child's own
        message, e.g. the port is taken) when it cannot. `claims`: the checkpoint directory
        faults are claimed in (ttp_set_checkpoint_dir), if already known. `capable`: whether
        this job's training code can recover in memory, and why not (RECOVERY.capability()
        of rank 0): the child has no Megatron to ask, and at fault time rank 0 may be gone."""
        mine, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this very tree
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mindio_ttp.control.controller.host", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._chan = _Channel(mine)
        self._chan.send(world_size=self.world_size, replica=self.replica,
                        host_rank=self.host_rank, ip=ip, port=port,
                        claims=None if claims is None else str(claims),
                        capable=[bool(capable[0]), str(capable[1])])
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            msgs = self._chan.recv(max(0.05, deadline - time.monotonic()))
            if msgs is None:
                break
            for m in msgs:
                if "error" in m:
                    self._reap(kill=True)
                    raise TTPError(m["error"])
                if "listening" in m:
                    self.address = (m["listening"][0], int(m["listening"][1]))
                    return self.address
        self._reap(kill=True)
        raise TTPError(f"the TTP controller process did not start listening on {ip}:{port} "
                       f"within {START_TIMEOUT_S:g} s (exit status {self._status()}); see its "
                       "log lines above")

    def _wait_for(self, key: str, timeout: float) -> Optional[Dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self._inbox):
                if key in m:
                    return self._inbox.pop(i)[key]
            left = deadline - time.monotonic()
            if left <= 0 or self._chan is None:
                return None
            msgs = self._chan.recv(left)
            if msgs is None:
                return None
            self._inbox += msgs

    def status(self, timeout: float = 10.0) -> Optional[Dict[str, Any]]:
        """The controller's state, how many ranks are registered and the faults it saw."""
        if self._chan is None:
            return None
        self._chan.send(status=True)
        return self._wait_for("status", timeout)

    def flow_report(self, timeout: float) -> Optional[Dict[str, Any]]:
        """What the controller's flow decided, with its timeline (monotonic times, comparable
        across processes on one machine), once it has: None if not within `timeout`."""
        return self._wait_for("flow", timeout)

    def set_claims(self, directory: Path) -> None:
        """ttp_set_checkpoint_dir ran after the start: the controller claims faults there."""
        if self._chan is not None:
            self._chan.send(claims=str(directory))

    def stop(self, wait_goodbyes: float = 0.0) -> None:
        """Normal end of training: the controller waits (bounded) for every rank's goodbye,
        tells the rest it is closing, and exits."""
        if self._chan is None or self.proc is None:
            return
        self._chan.send(stop=wait_goodbyes)
        try:
            self.proc.wait(Deadlines.controller_stop(wait_goodbyes))
        except subprocess.TimeoutExpired:
            log.warning("the TTP controller process (pid %d) did not stop: killing it",
                        self.proc.pid)
        self._reap(kill=True)

    def _status(self) -> Optional[int]:
        return self.proc.poll() if self.proc is not None else None

    def _reap(self, kill: bool) -> None:
        if self.proc is not None and kill and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        if self._chan is not None:
            self._chan.sock.close()
            self._chan = None


# -- the child ------------------------------------------------------------------------------------
def serve(fd: int) -> int:
    from mindio_ttp.control.controller.server import Controller

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan = _Channel(socket.socket(fileno=fd))
    first = chan.recv(START_TIMEOUT_S)
    if not first:
        return 2
    p = first[0]
    try:
        setup_logging(p["host_rank"])
        cfg = TTPConfig.from_env(world_size=p["world_size"])
        if p.get("claims"):
            C.register(p["claims"])
        told = p.get("capable") or NO_HOOKS
        capable = (bool(told[0]), str(told[1]))
        RECOVERY.capability = lambda: capable
        ctl = Controller(cfg, p["world_size"], p["replica"], p["host_rank"])
        address = ctl.listen(p["ip"], p["port"])
    except (TTPError, ValueError) as exc:
        chan.send(error=str(exc))
        return 2
    ctl.start()
    chan.send(listening=list(address), pid=os.getpid())
    return _run(ctl, chan, cfg)


def _run(ctl: Any, chan: _Channel, cfg: TTPConfig) -> int:
    parent_gone: Optional[float] = None
    while True:
        # What this process holds lives as long as it does: its modules, and a connection, a
        # decoder and a rank record per rank. A full collection walks every tracked object
        # while holding the GIL (seconds at 10k+ ranks on a busy node: acks stop, ranks take
        # the controller for lost), and the storm of registrations triggers one after another.
        # Freezing moves what exists into the permanent generation every turn, so collections
        # walk only what the last POLL_S made; frozen objects are still freed by refcount.
        gc.freeze()
        if parent_gone is None:
            msgs = chan.recv(POLL_S)
        else:
            time.sleep(POLL_S)
            msgs = []
        if msgs is None:
            parent_gone = time.monotonic()
            log.info("%s: rank %d, which started this controller process, has exited or been "
                     "lost (the controller does not depend on it); serving on", ctl.name,
                     ctl.host_rank)
            msgs = []
        for m in msgs:
            if "claims" in m and m["claims"]:
                C.register(m["claims"])
            if "status" in m:
                children, routed = ctl.routes.describe()
                chan.send(status={"state": ctl.sm.state.value, "registered": len(ctl.registered),
                                  "faults": ctl.faults[:100], "n_faults": len(ctl.faults),
                                  "children": children, "routed": routed,
                                  "redirects": ctl.routes.redirects})
            if "stop" in m:
                ctl.stop(wait_goodbyes=float(m["stop"]))
                return 0
        if ctl.decided.is_set():
            d = ctl.decision
            chan.send(flow={"outcome": d.outcome.value, "step": d.step, "savers": len(d.ranks),
                            "reason": d.reason[:500], "timeline": ctl.timeline,
                            "faults": ctl.faults[:100], "cpu_s": time.process_time()})
            # serve on until every rank has its exit order (each closes its connection when it
            # exits on it): frames still queued when this process exits would be lost, and
            # their ranks would wait out TTP_OT for a verdict. At 16k+ ranks on a busy node
            # the orders take longer than a handshake timeout to write; a rank still connected
            # after TTP_OT has stopped waiting for its verdict anyway.
            deadline = time.monotonic() + cfg.deadlines.orders_drain
            while ctl.registered and time.monotonic() < deadline:
                time.sleep(POLL_S)
            ctl.stop()
            return 0
        # Rank 0 gone (killed, or replaced by an in-memory recovery that let the job go on):
        # this process is the job's controller while any rank is connected to it, for as
        # long as training lasts; it ends once the last rank has left and no flow (an
        # in-memory recovery included) is under way.
        if parent_gone is not None and not ctl.flow_running and not ctl.registered:
            log.warning("%s: no rank left to serve; exiting", ctl.name)
            ctl.stop()
            return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m mindio_ttp.control.controller.host FD "
              "(started by ttp_start_controller)", file=sys.stderr)
        return 2
    return serve(int(args[0]))


if __name__ == "__main__":
    sys.exit(main())
