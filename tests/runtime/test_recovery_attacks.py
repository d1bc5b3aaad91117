"""The in-memory recovery's surfaces under attack (issue 24), over real loopback sockets: a real
controller recovers rank 1 of a 4-rank job (one DP group, replica 2); ranks 0-3 answer the
recovery as processors do (test_recovery_backups.RecoveringRank), and the replacement is a
real processor or a scripted rank that registers when the relay is asked for it.

* an outsider without the key who holds the controller's waiting slots kept the replacement
  out (the newest connection was refused), and the job fell back to the dying checkpoint;
* a key holder that is not the relay abandoned the recovery with a ReplaceStatus in another
  launcher's name;
* a replacement registering during the recovery was sent the flow's Lock and AdvanceTo."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Callable, List

import pytest

from mindio_ttp import hooks
from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.controller.state import ControllerState as S
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.recovery import rank as R

from .conftest import DP, ENV
from .fakes import FakeRank, real_processor, wait_for
from .test_recovery_backups import IN_MEMORY, RecoveringRank

WORLD = 4
CAP = WORLD + 64  # waiting connections the controller of a 4-rank job holds at most


@pytest.fixture(autouse=True)
def capable(monkeypatch):
    monkeypatch.setattr(R.RECOVERY, "capability", lambda: (True, ""))


class Job:
    """A controller on loopback that recovers in memory, and ranks 0-3 registered with it.
    When the relay is asked for a replacement, `on_replace(order)` runs in a thread."""

    def __init__(self, on_replace: Callable[[P.ReplaceOrder], None],
                 rank_cls: type = RecoveringRank, **env: str) -> None:
        self.ctl = Controller(TTPConfig.from_env({**ENV, **IN_MEMORY, **env}), WORLD, 2,
                              host_rank=0)
        self.ctl.listen("127.0.0.1", 0)
        self.ctl.start()
        self.ranks: List[FakeRank] = [rank_cls(self.ctl.address, r, WORLD, DP, 2,
                                               on_replace=on_replace) for r in DP]
        assert wait_for(lambda: len(self.ctl.registered) == WORLD)

    def recovered(self, n: int = 1) -> bool:
        """The controller committed `n` recoveries and serves again."""
        return self.ctl.flow.recovery._committed >= n and self.ctl.sm.is_in(S.SERVING) and \
            self.ctl.flow._thread is None

    def close(self) -> None:
        for f in self.ranks:
            f.close()
        self.ctl.stop()


def ready(order: P.ReplaceOrder, fake: FakeRank) -> None:
    fake.send(P.RecoverReady(order.recovery_id, order.rank, True, "", "", 0.01))


# -- item 5: a replacement gets exactly what it should -------------------------------------------
SEEN = (P.HeartbeatAck, P.Backups)  # what every registered rank gets, whatever happens


def orders(fake: FakeRank) -> List[str]:
    return [type(m).__name__ for m in list(fake.received) if not isinstance(m, SEEN)]


def test_a_replacement_registering_during_a_recovery_gets_no_lock_and_no_advance():
    """The controller replayed the flow's Lock and AdvanceTo to every rank registering mid-flow
    (flow.py's `_lock_msgs`, meant to stop that, was read by nobody): a replacement locked its
    updates, reported a state nobody read, and, once the grace ran out after the commit, was
    stopped for good (TTPForceStop at its first update). It gets its ack and the commit; and
    after the recovery, a later flow's replacement does not get the old flow's orders either,
    while the first replacement, now a member, takes part in that flow like any rank."""
    replacements: List[FakeRank] = []

    def replace(order: P.ReplaceOrder) -> None:  # it answers a later recovery as any rank
        fake = RecoveringRank(job.ctl.address, order.rank, WORLD, DP, 2, step=order.step,
                              on_replace=replace)
        replacements.append(fake)
        assert wait_for(lambda: fake.of_type(P.RegisterAck))
        ready(order, fake)

    job = Job(replace)
    try:
        job.ranks[1].close()  # rank 1 is lost
        assert wait_for(job.recovered, 20), job.ctl.sm.history
        first = replacements[0]
        assert wait_for(lambda: "RecoverCommit" in orders(first))
        assert orders(first) == ["RegisterAck", "RecoverCommit"], orders(first)
        # a second fault: rank 2 is lost and replaced; rank 1 (the first replacement) is a
        # member now and answers this flow's Lock and AdvanceTo
        before = len(first.received)
        job.ranks[2].close()
        assert wait_for(lambda: len(replacements) == 2 and job.recovered(2), 20), \
            job.ctl.sm.history
        second = replacements[1]
        assert wait_for(lambda: "RecoverCommit" in orders(second))
        assert orders(second) == ["RegisterAck", "RecoverCommit"], orders(second)
        later = [type(m).__name__ for m in list(first.received)[before:]
                 if not isinstance(m, SEEN)]
        assert later[:3] == ["Lock", "AdvanceTo", "RecoverOrder"], later
    finally:
        for f in replacements:
            f.close()
        job.close()


# -- item 2: only the relay speaks for a replacement ------------------------------------------
class KeyHolder(RecoveringRank):
    """Rank 3 holds the key and lies: on its RecoverOrder it says, in the name of the launchers
    of rank 1 (lost, relayed by rank 0) and rank 2 (not lost), that their replacements failed,
    then answers READY like an honest rank."""

    def _answer(self, m: P.Message) -> None:
        if isinstance(m, P.RecoverOrder) and self.rank == 3:
            for rank in (1, 2):
                self.send(P.ReplaceStatus(m.recovery_id, rank, "failed", 1, "says rank 3"))
        super()._answer(m)


def test_a_replace_status_from_a_rank_that_is_not_the_relay_is_refused_and_logged(caplog):
    """Rank 3 sent ReplaceStatus(rank=1, failed): the coordinator acted on msg.rank and
    abandoned the recovery (the dying checkpoint, and the log blamed rank 1's launcher). Now
    only plan.relays[1] (rank 0) speaks for rank 1's replacement; the recovery commits, and
    each refusal is logged with the sender's rank and address."""
    replacements: List[FakeRank] = []

    def replace(order: P.ReplaceOrder) -> None:
        # the refusals were logged before the relay heard of the order (rank 3's frames came
        # first on the I/O thread): the replacement only registers once they are
        assert wait_for(lambda: caplog.text.count("refused ReplaceStatus") == 2)
        fake = FakeRank(job.ctl.address, order.rank, WORLD, DP, 2, step=order.step)
        replacements.append(fake)
        assert wait_for(lambda: fake.of_type(P.RegisterAck))
        ready(order, fake)

    job = Job(replace, rank_cls=KeyHolder)
    try:
        peer = f"127.0.0.1:{job.ranks[3].sock.getsockname()[1]}"
        job.ranks[1].close()
        assert wait_for(job.recovered, 20), (job.ctl.sm.history, job.ctl.faults)
        assert not job.ctl.decided.is_set() and "recovery_abandoned" not in job.ctl.timeline
        refused = [r.getMessage() for r in caplog.records
                   if "refused ReplaceStatus" in r.getMessage()]
        assert len(refused) == 2 and all(r.levelname == "WARNING" for r in caplog.records
                                          if "refused ReplaceStatus" in r.getMessage())
        assert "for rank 1 from rank 3" in refused[0] and peer in refused[0] and \
            "its relay is rank 0" in refused[0], refused
        assert "for rank 2 from rank 3" in refused[1] and peer in refused[1] and \
            "rank 2 is not replaced" in refused[1], refused
    finally:
        for f in replacements:
            f.close()
        job.close()


# -- item 1: an outsider without the key cannot keep a replacement out ---------------------------
IP_BIND_ADDRESS_NO_PORT = 24


def idle_connections(addr, n: int, source: str = "") -> List[socket.socket]:
    """An outsider's connections that never send a byte (from `source` when given)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source:
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((source, 0))
        s.settimeout(5)
        s.connect(addr)
        socks.append(s)
    return socks


@pytest.mark.parametrize("sources", [[""], ["127.0.0.2", "127.0.0.3", "127.0.0.4",
                                            "127.0.0.5"]],
                         ids=["one address", "four addresses"])
def test_an_outsider_holding_every_waiting_slot_does_not_keep_the_replacement_out(sources):
    """During the recovery an outsider holds world_size + 64 idle connections (from the
    replacement's own address, or from four others); the controller refused the newest
    connection, the replacement's, which exited: the recovery was abandoned. Now a source's
    new connection displaces its own oldest idle one, and once every slot is taken the
    connections that have had their chance give way; the replacement (a real processor)
    registers, is neither locked nor counting down TTP_OT, and the recovery commits."""
    state: dict = {}
    flood: List[socket.socket] = []

    def replace(order: P.ReplaceOrder) -> None:
        for i in range(CAP):
            flood.extend(idle_connections(job.ctl.address, 1, sources[i % len(sources)]))
        assert wait_for(lambda: len(job.ctl._pending) >= min(CAP, 64 * len(sources)))
        # a replacement registers with the acting controller itself (start_processor_at with
        # its order's deadline does), not through a node agent
        with real_processor({**ENV, **IN_MEMORY, "TTP_NODE_AGENT": "0"}, order.rank, DP, WORLD,
                            2) as (proc, _):
            try:
                proc.start(*job.ctl.address)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                state["error"] = exc
                return
            state["locked"] = hooks.STATE.locked
            state["fault_time"] = proc._fault_time
            proc._report_ready(order.recovery_id, True, "", "", 0.01)
            assert wait_for(job.recovered, 20)

    job = Job(replace, TTP_HANDSHAKE_TIMEOUT="30")  # the flood is not timed out meanwhile
    try:
        job.ranks[1].close()
        assert wait_for(lambda: job.recovered() or "error" in state
                        or job.ctl.decided.is_set(), 30), job.ctl.sm.history
        assert "error" not in state, state["error"]
        assert job.recovered(), (job.ctl.faults, job.ctl.timeline)
        assert state["locked"] is False and state["fault_time"] is None, state
        assert job.ctl.evicted >= 1
        # the outsider still holds connections, never more than the cap
        assert len(job.ctl._pending) <= CAP
    finally:
        for s in flood:
            s.close()
        job.close()


class ClosingProxy:
    """A listener that closes its first `n` connections at once (before any byte) and relays
    the rest to `target`: what a rank sees from a controller that made room for others."""

    def __init__(self, target, n: int) -> None:
        self.target, self.n = target, n
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._open: List[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.n:
                c.close()
                continue
            up = socket.create_connection(self.target)
            self._open += [c, up]
            for a, b in ((c, up), (up, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()
        for c in self._open:
            c.close()


def test_a_processor_retries_a_handshake_closed_before_its_challenge(ctl):
    """A listener that closed the connection before its challenge (one that made room for
    newer connections) failed the rank at once ("no valid TTP handshake"); it tries again,
    within TTP_CONNECT_TIMEOUT, and registers."""
    proxy = ClosingProxy(ctl.address, 3)
    try:
        with real_processor(ENV, 2, DP, WORLD, 2) as (proc, _):
            proc.start("127.0.0.1", proxy.port)
            assert proxy.accepted == 4 and wait_for(lambda: ctl.registered == [2])
    finally:
        proxy.close()
