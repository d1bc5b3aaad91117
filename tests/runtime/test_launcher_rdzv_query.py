"""The agent's rendezvous-store query runs off its monitor loop (mindio_ttp.launch.agent): a store
whose node went silent blocks each call for torch's read_timeout, and the agent must go on
watching its workers meanwhile. Real threads, no torch store."""

from __future__ import annotations

import threading
import time

from mindio_ttp.launch.agent import _OffLoopQuery


def test_a_store_that_does_not_answer_does_not_hold_the_caller() -> None:
    release = threading.Event()
    calls = []

    def blocked() -> int:
        calls.append(1)
        assert release.wait(30)
        return 2

    query = _OffLoopQuery(blocked, wait_s=0.2)
    start = time.monotonic()
    assert query() == 0  # no answer yet: "nobody waiting", torch changes nothing
    assert time.monotonic() - start < 5
    assert query.in_flight and query() == 0 and len(calls) == 1  # one query at a time
    release.set()
    deadline = time.monotonic() + 10
    while query.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not query.in_flight and query.error is None
    assert query() == 2 and len(calls) == 2  # a healthy store answers within wait_s


def test_a_failed_query_is_kept_and_not_repeated() -> None:
    calls = []

    def broken() -> int:
        calls.append(1)
        raise ConnectionError("store gone")

    query = _OffLoopQuery(broken, wait_s=5)
    assert query() == 0
    assert isinstance(query.error, ConnectionError)
    assert query() == 0 and len(calls) == 1
