"""Hot path and decorator semantics, without any network."""

from __future__ import annotations

import threading
import time

import pytest

import mindio_ttp.framework_ttp as ttp
from mindio_ttp import hooks


@pytest.fixture(autouse=True)
def fresh_state():
    hooks.STATE.reset()
    yield
    hooks.STATE.reset()


def step(n: int) -> None:
    ttp.ttp_start_updating_os(-1)
    ttp.ttp_end_updating_os(n)


def test_hot_path_costs_microseconds():
    n = 20000
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        ttp.ttp_start_updating_os(-1)
        ttp.ttp_end_updating_os(i)
        ttp.ttp_set_ckpt_args((i,))
    per_step = (time.perf_counter() - t0) / n
    assert per_step < 50e-6, f"{per_step * 1e6:.1f} us per step"
    assert hooks.STATE.snapshot() == (n, False)


def test_unlocked_state_tracks_window():
    ttp.ttp_start_updating_os(-1)
    assert hooks.STATE.snapshot() == (None, True)
    ttp.ttp_end_updating_os(1)
    assert hooks.STATE.snapshot() == (1, False)


def test_locked_rank_at_the_limit_is_force_stopped():
    step(1)
    step(2)
    assert hooks.STATE.lock() == (2, False)
    assert hooks.STATE.advance_to(2, grace=0.0) == (2, False)
    with pytest.raises(ttp.TTPForceStop) as info:
        ttp.ttp_start_updating_os(-1)
    assert isinstance(info.value, RuntimeError)


def test_locked_rank_waits_then_may_catch_up_to_the_limit():
    step(1)
    hooks.STATE.lock()
    result = {}

    def trainer():
        ttp.ttp_start_updating_os(-1)  # blocks until the controller sets the limit
        result["started"] = time.monotonic()
        ttp.ttp_end_updating_os(2)
        try:
            ttp.ttp_start_updating_os(-1)
        except ttp.TTPForceStop:
            result["stopped"] = True

    t = threading.Thread(target=trainer)
    t.start()
    time.sleep(0.2)
    assert "started" not in result
    assert hooks.STATE.advance_to(2, grace=5.0) == (2, False)
    t.join(5)
    assert result.get("stopped") is True


def test_rank_inside_window_gets_the_grace_to_finish():
    step(1)
    ttp.ttp_start_updating_os(-1)
    assert hooks.STATE.lock() == (1, True)
    threading.Timer(0.1, ttp.ttp_end_updating_os, args=(2,)).start()
    t0 = time.monotonic()
    assert hooks.STATE.advance_to(2, grace=5.0) == (2, False)
    assert time.monotonic() - t0 < 2.0


def test_rank_stuck_in_window_is_reported_updating_after_grace():
    ttp.ttp_start_updating_os(-1)
    t0 = time.monotonic()
    assert hooks.STATE.advance_to(1, grace=0.2) == (None, True)
    assert 0.15 < time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("seed", range(3))
def test_hooks_race_with_the_two_phase_lock(seed, monkeypatch):
    """A trainer thread runs the hooks flat out while this thread plays the processor
    at random moments (GIL switch interval 1 us to force interleavings): whatever `lock` reports
    must hold (a rank reported clean at t never moves past t unless the controller allows it),
    and after `advance_to(limit)` the rank sits clean at exactly `limit` and is force-stopped."""
    import random
    import sys

    rng = random.Random(seed)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(60):
            hooks.STATE.reset()
            hooks.STATE.wait_limit = 10.0
            out = {}

            def trainer(out: dict = out) -> None:
                n = 0
                try:
                    while True:
                        ttp.ttp_start_updating_os(-1)
                        out["began"] = n + 1
                        n += 1
                        ttp.ttp_end_updating_os(n)
                except ttp.TTPForceStop:
                    out["stopped_at"] = n

            t = threading.Thread(target=trainer)
            t.start()
            time.sleep(rng.uniform(0, 0.002))
            step, updating = hooks.STATE.lock()
            if not updating:
                time.sleep(0.002)  # a clean rank must stay where it was reported
                assert hooks.STATE.snapshot() == (step, False)
                assert out.get("began", 0) <= (step or 0)
            limit = (step or 0) + (1 if updating else 0)
            assert hooks.STATE.advance_to(limit, grace=5.0) == (limit, False)
            t.join(5)
            assert not t.is_alive() and out["stopped_at"] == limit
            assert out.get("began", 0) == limit
    finally:
        sys.setswitchinterval(old)


def test_decorator_without_runtime_reraises_and_returns():
    @ttp.ttp_to_persist
    def train(x):
        if x:
            raise KeyError("boom")
        return 7

    assert train(0) == 7
    with pytest.raises(KeyError):
        train(1)
    assert train.__name__ == "train"


def test_decorator_reports_then_waits_for_the_verdict(monkeypatch):
    class FakeRuntime:
        running, fault_seen, ot = True, False, 0.05
        reported = None

        def __init__(self):
            self.waits = []

        def report_exception(self, exc):
            self.reported = exc

        def wait_for_exit(self, timeout):  # no exit order comes
            self.waits.append(timeout)
            time.sleep(timeout)
            return False

    rt = FakeRuntime()
    monkeypatch.setattr(hooks, "RUNTIME", rt)

    @ttp.ttp_to_persist
    def train():
        step(1)  # one update finished: this rank may serve step 1
        raise ValueError("bad batch")

    with pytest.raises(ValueError):  # no exit order came: re-raised after TTP_OT
        train()
    assert isinstance(rt.reported, ValueError)
    # the whole TTP_OT, in slices short enough to run an allowed catch-up in time
    assert sum(rt.waits) == pytest.approx(0.05, abs=0.02)
    assert max(rt.waits) <= hooks.CATCH_UP_POLL_S


def test_decorator_reraises_at_once_before_the_first_update(monkeypatch):
    class FakeRuntime:
        running, fault_seen, ot = True, False, 30.0
        reported = None

        def report_exception(self, exc):
            self.reported = exc

        def wait_for_exit(self, timeout):
            raise AssertionError("a rank with nothing to persist must not wait for a verdict")

    rt = FakeRuntime()
    monkeypatch.setattr(hooks, "RUNTIME", rt)

    @ttp.ttp_to_persist
    def train():
        raise ValueError("refused configuration")

    with pytest.raises(ValueError, match="refused configuration"):
        train()
    assert isinstance(rt.reported, ValueError)
