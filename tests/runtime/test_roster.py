"""The controller's small parts on their own: the rank table (roster.py) and the flow's outbox
over the I/O thread's mailbox (controller.MailOutbox)."""

from __future__ import annotations

import threading
import time

from mindio_ttp.control.controller.roster import RankInfo, Roster
from mindio_ttp.control.controller.server import MailOutbox
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire.transport import Mailbox


def info(rank: int) -> RankInfo:
    return RankInfo(rank, (0, 1, 2, 3), "127.0.0.1", 0, None, time.monotonic())


def test_the_alive_count_follows_registrations_deaths_and_returns() -> None:
    roster = Roster()
    for r in range(4):
        roster.register(info(r))
    roster.register(info(2))  # a live rank replacing its own connection: still one rank
    assert roster.n_alive == 4 and roster.alive() == [0, 1, 2, 3]
    assert roster.set_status(roster[1], "dead", "dead (connection dropped)") is True
    assert roster.set_status(roster[1], "hung", "hung") is False, "it left 'alive' once"
    assert roster.n_alive == 3 and roster.alive() == [0, 2, 3]
    assert roster[1].note == "hung"
    roster.set_status(roster[3], "gone", "finished training")
    roster.register(info(3))  # a rank that said goodbye and registered again counts again
    assert roster.n_alive == 3 and roster.alive() == [0, 2, 3]
    assert roster.get(7) is None


def test_the_outbox_queues_for_the_io_thread_and_flush_waits_for_it() -> None:
    """Each call is queued as the I/O thread's own method and runs only there, in order."""
    mail = Mailbox()
    ran: list = []
    flushed: list = []
    try:
        out = MailOutbox(mail, lambda m, ex: ran.append(("broadcast", m, ex)),
                         lambda rs, m: ran.append(("send_many", rs, m)),
                         lambda r, m: ran.append(("send", r, m)), flushed.append)
        lock, exit_order = P.Lock(3), P.ExitOrder(3, "saved", 5, [0], 83, "ok")
        out.broadcast(lock)
        out.send_many([0, 2], lock)
        out.send(0, exit_order)
        assert ran == [], "nothing runs on the caller's thread"
        mail.run_all()
        assert ran == [("broadcast", lock, None), ("send_many", [0, 2], lock),
                       ("send", 0, exit_order)]
        assert out.flush(0.05) is False, "nobody wrote the frames: flush must time out"
        mail.run_all()
        assert len(flushed) == 1  # that one's waiter gave up
        flushed.clear()

        def io_thread() -> None:  # what the controller's loop does once the buffers are empty
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                mail.run_all()
                if flushed:
                    flushed[0].set()
                    return
                time.sleep(0.01)
        t = threading.Thread(target=io_thread)
        t.start()
        assert out.flush(5) is True
        t.join(5)
    finally:
        mail.close()
