"""The backup list after an in-memory recovery: a real controller on loopback, ranks that answer
the recovery as processors do (fakes.FakeRank), a replacement that registers with a new standby
port. Before the list was refreshed, it kept naming the lost rank's dead listener after the
recovery, and a standby promoted on a failover never announced one; so a job that lost its
serving controller after a recovery found no backup alive (the TP2 every-fault-kind e2e run of
2026-12-05: exit 86, nothing saved)."""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import pytest

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.controller.state import ControllerState as S
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.recovery import rank as R

from .conftest import DP, ENV
from .fakes import FakeRank, wait_for

IN_MEMORY = {"TTP_RECOVERY": "in-memory", "TTP_REPLACEMENTS": "cold", "TTP_RECOVER_TIMEOUT": "10"}


class RecoveringRank(FakeRank):
    """Answers the recovery: READY to its RecoverOrder; as the relay, reports the replacement
    started and hands the order to `on_replace` (which starts the replacement)."""

    def __init__(self, *args, on_replace: Optional[Callable[[P.ReplaceOrder], None]] = None,
                 **kwargs) -> None:
        self.on_replace = on_replace
        super().__init__(*args, **kwargs)

    def _answer(self, m: P.Message) -> None:
        if isinstance(m, P.RecoverOrder):
            self.send(P.RecoverReady(m.recovery_id, self.rank, True, "", "", 0.01))
        elif isinstance(m, P.ReplaceOrder):
            self.send(P.ReplaceStatus(m.recovery_id, m.rank, "started", 4242, "by the test"))
            assert self.on_replace is not None
            threading.Thread(target=self.on_replace, args=(m,), daemon=True).start()
        else:
            super()._answer(m)


@pytest.fixture(autouse=True)
def capable(monkeypatch):
    monkeypatch.setattr(R.RECOVERY, "capability", lambda: (True, ""))


class Job:
    """A controller on loopback and the fake ranks that registered with it; `replacement`
    fills in when the controller orders one (standby port 6000 + rank)."""

    def __init__(self, host: int, standby: bool) -> None:
        self.ctl = Controller(TTPConfig.from_env({**ENV, **IN_MEMORY}), 4, 2, host_rank=host,
                              standby=standby)
        self.ctl.listen("127.0.0.1", 0)
        self.ctl.start()
        self.fakes: List[FakeRank] = []
        self.replacement: List[FakeRank] = []

    def rank(self, r: int) -> FakeRank:
        fake = RecoveringRank(self.ctl.address, r, 4, DP, 2, standby_port=5000 + r,
                              on_replace=self._replace)
        self.fakes.append(fake)
        return fake

    def _replace(self, order: P.ReplaceOrder) -> None:
        fake = FakeRank(self.ctl.address, order.rank, 4, DP, 2, step=order.step,
                        standby_port=6000 + order.rank)
        self.replacement.append(fake)
        fake.send(P.RecoverReady(order.recovery_id, order.rank, True, "", "", 0.01))

    def recovered(self) -> bool:
        return bool(self.replacement) and self.ctl.sm.is_in(S.SERVING) and \
            self.ctl.flow._thread is None

    def assert_everyone_learns(self, expected: List[tuple]) -> None:
        ranks = [f for f in self.fakes if not f._stop.is_set()] + self.replacement
        for fake in ranks:
            assert wait_for(lambda f=fake: announced(f) == expected, 5), \
                (fake.rank, fake.of_type(P.Backups)[-1:], expected)

    def close(self) -> None:
        for fake in self.fakes + self.replacement:
            fake.close()
        self.ctl.stop()


def announced(fake: FakeRank) -> List[tuple]:
    """(rank, port) of the last backup list `fake` received: in a Backups broadcast, or in its
    RegisterAck (a rank registering after the list's broadcast gets it there only: under load,
    rank 3 registered after the broadcast of [1, 2] and waited for one that never came)."""
    lists = [m for m in list(fake.received) if isinstance(m, (P.Backups, P.RegisterAck))]
    return [(b[0], b[2]) for b in lists[-1].backups] if lists else []


def test_after_a_recovery_every_rank_learns_backups_that_are_alive():
    """Rank 1 (the first backup) is lost and replaced; its replacement listens on 6001. Every
    rank, the replacement too, learns [rank 1 at 6001, rank 2], not the dead 5001."""
    job = Job(host=0, standby=False)
    try:
        for r in DP:
            job.rank(r)
        assert wait_for(lambda: announced(job.fakes[3]) == [(1, 5001), (2, 5002)], 5)
        job.fakes[1].close()  # rank 1 dies
        assert wait_for(job.recovered, 20), job.ctl.sm.history
        assert [b for _, b, _ in job.ctl.sm.history][-2:] == [S.RECOVERING, S.SERVING]
        job.assert_everyone_learns([(1, 6001), (2, 5002)])
    finally:
        job.close()


def test_a_promoted_standby_announces_backups_after_its_recovery():
    """Rank 0 and the primary controller are lost; ranks 1-3 fail over to the standby on rank 3,
    which recovers rank 0 in memory. It had announced no list (it learned none while it stood
    by); now every rank learns [rank 0 at 6000, rank 1], never its own rank 3."""
    job = Job(host=3, standby=True)
    job.ctl.flow.known_hosts[0] = "127.0.0.1"  # what the processor on rank 3 tells it
    try:
        for r in (1, 2, 3):
            job.rank(r)
        assert wait_for(job.recovered, 30), (job.ctl.sm.history, job.ctl.faults)
        job.assert_everyone_learns([(0, 6000), (1, 5001)])
    finally:
        job.close()
