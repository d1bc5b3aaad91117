"""One real Processor (this process's hot state) with the real Controller and scripted peers."""

from __future__ import annotations

import json
import threading
import time

import pytest

from mindio_ttp import hooks
from mindio_ttp.config import Outcome, TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.rank.processor import Processor
from mindio_ttp.handlers import HANDLERS
from mindio_ttp.launch.desk import LauncherDesk

from .fakes import KEY, FakeRank

DP = [0, 1, 2, 3]


def cfg(tmp_path, **over):
    env = {"TTP_AUTH_KEY": KEY.hex(), "TTP_HEARTBEAT_INTERVAL": "0.1",
           "TTP_HEARTBEAT_TIMEOUT": "0.8", "TTP_UPDATE_GRACE": "0.3", "TTP_COLLECT_TIMEOUT": "1",
           "TTP_SAVE_TIME_LIMIT": "0.5", "TTP_RENAME_TIME_LIMIT": "1", "TTP_OT": "20",
           "TTP_CONNECT_TIMEOUT": "3", "TTP_RUN_DIR": str(tmp_path / "run")}
    env.update(over)
    return TTPConfig.from_env(env)


@pytest.fixture
def job(tmp_path):
    hooks.STATE.reset()
    saved = dict(HANDLERS)
    made = {"fakes": [], "procs": [], "ctls": []}

    def start(rank=0, save=None, rename=None, fake_step=3, **over):
        c = cfg(tmp_path, **over)
        ctl = Controller(c, 4, 2, host_rank=rank)
        ctl.listen("127.0.0.1", 0)
        ctl.start()
        made["ctls"].append(ctl)
        HANDLERS["save"], HANDLERS["rename"] = save, rename
        proc = Processor(c, rank, DP, 4, 2)
        proc.launcher = LauncherDesk(c.run_dir, rank)  # as the API face hands it
        codes = []
        proc.exit_fn = codes.append
        proc.start("127.0.0.1", ctl.address[1])
        made["procs"].append(proc)
        fakes = [FakeRank(ctl.address, r, 4, DP, 2, step=fake_step) for r in range(4)
                 if r != rank]
        made["fakes"] += fakes
        while len(ctl.registered) < 4:
            time.sleep(0.01)
        return ctl, proc, codes, {f.rank: f for f in fakes}

    yield start
    for f in made["fakes"]:
        f.close()
    for p in made["procs"]:
        p._stop.set()
        p._mail.wake()
        if p.standby:
            p.standby.stop()
    for c in made["ctls"]:
        c.stop()
    HANDLERS.update(saved)
    hooks.STATE.reset()


def train_to(step):
    for s in range(1, step + 1):
        hooks.start_updating_os(-1)
        hooks.end_updating_os(s)


def test_saver_runs_handlers_off_the_main_thread_and_exits_with_the_order(job, tmp_path):
    calls = []

    def save(step, ranks, args):
        calls.append(("save", step, ranks, args, threading.current_thread().name))

    def rename(step, args):
        calls.append(("rename", step, args))

    train_to(3)
    hooks.set_ckpt_args((3, "model"))
    ctl, proc, codes, fakes = job(save=save, rename=rename)
    fakes[1].close()
    assert proc.exited.wait(10), ctl.faults
    assert codes == [83]
    assert calls[0][:4] == ("save", 3, [0, 3], (3, "model"))
    assert calls[0][4] == "ttp-save-handler"
    assert calls[1] == ("rename", 3, (3, "model"))
    flow = json.loads((tmp_path / "run" / "flow-finished.json").read_text())
    assert flow["outcome"] == "saved" and flow["step"] == 3 and flow["ranks"] == [0, 3]
    # the processor's table (control/rank/state.py): registered, the lock, the exit order
    assert [new.value for _, new, _ in proc.machine.history] == ["training", "fault", "exiting"]
    assert proc.fault_seen is False and proc.running and not proc.machine.protected
    proc._exit(Outcome.NO_VERDICT, None, [], "a second exit")  # at most one exit, one record
    assert codes == [83]
    assert json.loads((tmp_path / "run" / "flow-finished.json").read_text()) == flow
    with pytest.raises(hooks.TTPForceStop):
        hooks.start_updating_os(-1)


def test_save_over_its_time_limit_is_ordered_again_from_the_other_holder(job):
    """Rank 0 (shard 0) misses its deadline: rank 2, the other clean holder, saves shard 0."""
    release = threading.Event()
    train_to(3)
    ctl, proc, codes, fakes = job(save=lambda s, r, a: release.wait(10), rename=None)
    fakes[1].close()
    try:
        assert proc.exited.wait(10)
        assert codes == [83]
        assert ctl.decision.ranks == [2, 3]
    finally:
        release.set()


def test_save_over_its_time_limit_with_no_other_holder_fails_the_flow(job):
    release = threading.Event()
    train_to(3)
    ctl, proc, codes, fakes = job(save=lambda s, r, a: release.wait(10), rename=None)
    fakes[2].step = 2  # shard 0's other holder is behind: nobody can replace rank 0
    fakes[1].close()
    try:
        assert proc.exited.wait(10)
        assert codes == [85]
        assert "exceeded its time limit" in ctl.decision.reason
    finally:
        release.set()


def test_missing_handler_is_reported_not_hung(job):
    train_to(3)
    ctl, proc, codes, fakes = job(save=None)
    fakes[2].step = 2  # no other clean holder of rank 0's shard to order the save from
    fakes[1].close()
    assert proc.exited.wait(10) and codes == [85]
    assert "no save handler registered on rank 0" in ctl.decision.reason


def test_controller_lost_without_backups_ends_with_no_verdict(job):
    train_to(2)
    ctl, proc, codes, fakes = job(rank=1, TTP_OT="1")
    assert proc._backups == []  # scripted peers host no standby
    t0 = time.monotonic()
    ctl._stop.set()  # the controller dies: sockets close, no Closing notice
    ctl._mail.wake()
    ctl._thread.join(5)
    ctl._close_all()
    assert proc.exited.wait(10)
    assert codes == [86] and time.monotonic() - t0 < 5
    with pytest.raises(hooks.TTPForceStop):  # locked itself, then stopped waiting
        hooks.STATE.wait_limit = 0.1
        hooks.start_updating_os(-1)


def _die(ctl):
    """Abrupt controller death: sockets close, no Closing notice."""
    ctl._stop.set()
    ctl._mail.wake()
    ctl._thread.join(5)
    ctl._close_all()


def test_failover_walks_the_primary_backup_list_past_a_dead_standby(tmp_path):
    hooks.STATE.reset()
    c = cfg(tmp_path)
    primary = Controller(c, 4, 2, host_rank=0)
    primary.listen("127.0.0.1", 0)
    primary.start()
    standbys = {r: Controller(c, 4, 2, host_rank=r, standby=True) for r in (1, 2)}
    for sb in standbys.values():
        sb.listen("127.0.0.1", 0)
        sb.start()
    fakes = [FakeRank(primary.address, r, 4, DP, 2, standby_port=standbys[r].address[1])
             for r in (1, 2)]
    proc = Processor(c, 3, DP, 4, 2)
    proc.exit_fn = lambda code: None
    try:
        proc.start("127.0.0.1", primary.address[1])
        deadline = time.monotonic() + 5
        while [b[0] for b in proc._backups] != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [b[0] for b in proc._backups] == [1, 2]
        _die(primary)
        while standbys[1].registered != [3] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert standbys[1].registered == [3]
        _die(standbys[1])  # the first backup dies too, before reaching a quorum
        deadline = time.monotonic() + 5
        while standbys[2].registered != [3] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert standbys[2].registered == [3], "must fail over to the second backup"
    finally:
        for f in fakes:
            f.close()
        proc._stop.set()
        proc._mail.wake()
        proc.standby.stop()
        for ctl in (primary, *standbys.values()):
            ctl.stop()
        hooks.STATE.reset()


class PerThreadDevice:
    """An accelerator module with CUDA's semantics: the current device is per host thread and
    a new thread starts on device 0 (torch_npu: unbound until set_device)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, index: int) -> None:
        self._local.index = index


def test_handler_threads_run_on_the_device_training_set(job, monkeypatch):
    import torch

    import mindio_ttp.framework_ttp as ttp

    fake = PerThreadDevice()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    fake.set_device(3)  # what Megatron's initialize does in the main thread (local rank 3)
    seen = []

    def save(step, ranks, args):
        seen.append(("save", fake.current_device()))

    def rename(step, args):
        seen.append(("rename", fake.current_device()))

    ttp.ttp_register_save_ckpt_handler(save)
    assert HANDLERS["device"].describe() == "npu:3"
    train_to(3)  # the scripted peers hold step 3
    ctl, proc, codes, fakes = job(save=save, rename=rename)
    fakes[1].close()
    assert proc.exited.wait(10) and codes == [83], ctl.faults
    assert seen == [("save", 3), ("rename", 3)], ctl.decision


def test_no_accelerator_binds_nothing(monkeypatch):
    import torch

    from mindio_ttp.faulttime import device

    monkeypatch.delattr(torch, "npu", raising=False)
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        pytest.skip("a CUDA device is present")
    assert device.capture() == device.NO_DEVICE
    device.NO_DEVICE.bind()  # a no-op, not an error


def test_an_exception_raised_while_waiting_for_the_verdict_does_not_end_the_wait(
    job, monkeypatch
):
    """torch's DataLoader SIGCHLD handler raises in the main thread for every worker the
    preemption killed, also during the decorator's wait: the wait must go on to the verdict."""
    import os
    import signal

    import mindio_ttp.framework_ttp as ttp

    delivered = threading.Event()

    def raise_in_main_thread(signum, frame):
        delivered.set()
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

    old = signal.signal(signal.SIGUSR1, raise_in_main_thread)
    sender = None
    try:
        train_to(3)
        hooks.set_ckpt_args((3, "model"))
        # the save waits for the signal, so it lands while train() waits for the verdict
        ctl, proc, codes, fakes = job(save=lambda s, r, a: delivered.wait(5),
                                      rename=lambda s, a: None)
        monkeypatch.setattr(ttp, "_processor", proc)
        monkeypatch.setattr(hooks, "RUNTIME", ttp._RUNTIME)
        waiting = threading.Event()
        real_wait = proc.wait_for_exit

        def wait_for_exit(timeout):
            waiting.set()
            return real_wait(timeout)

        monkeypatch.setattr(proc, "wait_for_exit", wait_for_exit)

        def during_the_wait():
            if waiting.wait(10):  # the decorator is in its wait for the verdict
                os.kill(os.getpid(), signal.SIGUSR1)  # the second worker's SIGCHLD, say

        @hooks.to_persist
        def train():
            nonlocal sender
            sender = threading.Thread(target=during_the_wait, daemon=True)
            sender.start()
            raise RuntimeError("DataLoader worker (pid 0) is killed by signal: Terminated.")

        with pytest.raises(RuntimeError, match=r"pid 0"):  # the first error, after the verdict
            train()
        assert delivered.is_set() and codes == [83], ctl.faults
    finally:
        if sender is not None:
            sender.join(15)
        signal.signal(signal.SIGUSR1, old)


def test_a_rank_the_barrier_failed_for_catches_up_to_its_ready_update(job, monkeypatch):
    """Rank 2 dies inside the guide's barrier: its partners 1 and 3 passed it and finished
    step 4, while the barrier raised on rank 0, still at step 3 with step 4's update ready.
    Rank 0 is shard 0's only live holder: without the catch-up no step has every shard."""
    import mindio_ttp.framework_ttp as ttp

    train_to(3)
    ran, saved = [], []
    ctl, proc, codes, fakes = job(save=lambda s, r, a: saved.append((s, r)),
                                  rename=lambda s, a: None, fake_step=4)
    monkeypatch.setattr(ttp, "_processor", proc)
    monkeypatch.setattr(hooks, "RUNTIME", ttp._RUNTIME)

    @hooks.to_persist
    def train():
        ttp.ttp_offer_update(4, lambda: ran.append(threading.current_thread().name))
        fakes[2].close()  # dies inside the barrier
        raise RuntimeError("[../gloo/transport/tcp/pair.cc] Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        train()
    assert ran == ["MainThread"]  # the update ran once, on the training thread
    assert codes == [83], ctl.decision
    assert ctl.decision.step == 4 and 0 in ctl.decision.ranks, ctl.decision
    assert saved and saved[0][0] == 4


def test_an_offer_is_not_run_past_the_controllers_limit(job, monkeypatch):
    """The partners are at step 3 like this rank: the limit is 3, so the offered update of 4
    must not run (it would make this rank disagree with every other holder)."""
    import mindio_ttp.framework_ttp as ttp

    train_to(3)
    ran = []
    ctl, proc, codes, fakes = job(save=lambda s, r, a: None, rename=lambda s, a: None)
    monkeypatch.setattr(ttp, "_processor", proc)
    monkeypatch.setattr(hooks, "RUNTIME", ttp._RUNTIME)

    @hooks.to_persist
    def train():
        ttp.ttp_offer_update(4, lambda: ran.append(4))
        raise RuntimeError("barrier failed")

    with pytest.raises(RuntimeError, match="barrier failed"):
        train()
    assert ran == [] and codes == [83] and ctl.decision.step == 3, ctl.decision


def test_the_normal_path_withdraws_the_offer():
    hooks.STATE.reset()
    hooks.offer_update(1, lambda: None)
    hooks.start_updating_os(-1)
    assert hooks.STATE.offer is None
    hooks.end_updating_os(1)
    hooks.STATE.reset()


def test_an_exception_raised_into_the_report_does_not_lose_it(job, monkeypatch):
    """The second killed DataLoader worker's SIGCHLD can raise while the decorator is still
    reporting the first error (seen in a Slurm-style preemption of real Megatron): the report
    must still go out and the wait must follow."""
    import mindio_ttp.framework_ttp as ttp

    train_to(3)
    hooks.set_ckpt_args((3, "model"))
    ctl, proc, codes, fakes = job(save=lambda s, r, a: None, rename=lambda s, a: None)
    monkeypatch.setattr(ttp, "_processor", proc)
    monkeypatch.setattr(hooks, "RUNTIME", ttp._RUNTIME)
    real_report = proc.report_exception
    calls = []

    def report_exception(exc, kind=""):
        calls.append(exc)
        if len(calls) == 1:  # interrupted before it reached the processor
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")
        real_report(exc, kind)

    monkeypatch.setattr(proc, "report_exception", report_exception)

    @hooks.to_persist
    def train():
        raise RuntimeError("DataLoader worker (pid 0) is killed by signal: Terminated.")

    with pytest.raises(RuntimeError, match=r"pid 0"):
        train()
    assert len(calls) == 2 and codes == [83], ctl.faults
    assert any("pid 0" in f for f in map(str, ctl.faults)), ctl.faults
