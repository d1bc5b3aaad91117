"""The survivor's step out of the old world (megatron_ttp/rejoin._destroy_groups) on CPU: it
never goes on after an abort that did not work, never waits unbounded for a destroy, and checks,
bounded, that the device drained before a new world is built (D6). A real one-rank gloo world;
Megatron's mpu is a stand-in (only its destroy is called)."""

from __future__ import annotations

import importlib
import sys
import tempfile
import threading
import time
import types
from datetime import timedelta
from typing import Iterator, List

import pytest
import torch
import torch.distributed as dist

from mindio_ttp import config
from mindio_ttp.faulttime import abort, device_copy
from mindio_ttp.faulttime.device import DeviceBinding
from mindio_ttp.megatron_ttp import rejoin


@pytest.fixture
def survivor(monkeypatch) -> Iterator[rejoin.Rejoin]:
    calls: List[str] = []
    importlib.import_module("mindio_ttp.compat")  # a patched tree imports it before Megatron
    core = types.ModuleType("megatron.core")
    core.mpu = types.SimpleNamespace(destroy_model_parallel=lambda: calls.append("mpu destroyed"))
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    monkeypatch.setattr(rejoin, "_detach_model_groups", lambda model: [])
    monkeypatch.setattr(config, "ABORT_TIMEOUT_S", 1.0)
    stop = getattr(device_copy, "STOP", None)
    (stop.reset if stop is not None else device_copy.GATHERED.reset)()
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    held = rejoin.Rejoin(order=None, role="survivor", rank=0,
                         optimizer=types.SimpleNamespace(pair_group="old"))
    held.calls = calls  # type: ignore[attr-defined]
    destroy = dist.destroy_process_group  # the real one: a test may stand in a hung one
    try:
        yield held
    finally:
        if dist.is_initialized():
            destroy()
        device_copy.MARK.reset()
        (stop.reset if stop is not None else device_copy.GATHERED.reset)()


def _in_thread(fn, timeout_s: float) -> dict:
    box: dict = {}

    def run() -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    thread.join(timeout_s)
    box["alive"], box["seconds"] = thread.is_alive(), time.monotonic() - t0
    return box  # a thread still alive fills "error" when it ends


def test_a_failed_abort_fails_the_recovery_at_once_and_destroys_nothing(survivor,
                                                                        monkeypatch) -> None:
    failed = abort.AbortReport((abort.GroupAbort("dp", "nccl", abort.TIMED_OUT, "after 10 s"),),
                               "", False, 10.0)
    monkeypatch.setattr(abort, "abort_all", lambda *a, **k: failed)
    box = _in_thread(lambda: rejoin._destroy_groups(survivor), 10.0)
    assert not box["alive"]
    assert "not all aborted" in str(box.get("error")), box
    assert dist.is_initialized() and survivor.calls == []  # nothing torn down beside it


def test_a_destroy_that_does_not_return_fails_the_recovery_within_its_bound(survivor,
                                                                         monkeypatch) -> None:
    """torch 2.6's graceful shutdown waits for every unfinished kernel of a group that was not
    aborted: that wait had no end, and the controller waited for the recovery's READY until
    TTP_RECOVER_TIMEOUT. Now a watchdog fails the recovery once the bound has passed (the
    controller saves meanwhile), and the survivor fails its step if the destroy ever returns."""
    from mindio_ttp.recovery import rank as R

    recovery = R.RankRecovery()
    reports: List[tuple] = []
    recovery.reporter = lambda *a: reports.append(a)
    recovery.ordered(R.RecoveryOrder(1, 1, 3, (1,), "ns", "", 120.0))
    monkeypatch.setattr(rejoin, "RECOVERY", recovery)
    hung = threading.Event()
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: hung.wait())
    box = _in_thread(lambda: rejoin._destroy_groups(survivor), 3.0)
    assert box["alive"], "the destroy returned although it hangs"
    assert reports and reports[0][1] is False, reports  # failed within the bound (1 s)
    assert "did not return within 1 s" in reports[0][2] and recovery.abandoned
    hung.set()
    deadline = time.monotonic() + 5
    while "error" not in box and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "did not return within 1 s" in str(box.get("error")), box


def test_a_device_that_does_not_drain_is_caught_before_the_new_world(survivor,
                                                                     monkeypatch) -> None:
    """NVRx's CudaHealthCheck: a bounded synchronize (twice) before re-initialising."""
    hung = threading.Event()
    fake = types.SimpleNamespace(set_device=lambda i: None, synchronize=hung.wait,
                                 Event=lambda: types.SimpleNamespace(record=lambda: None))
    monkeypatch.setattr(torch, "cuda", fake)
    device_copy.MARK.install(DeviceBinding("cuda", 0), module=fake)
    box = _in_thread(lambda: rejoin._destroy_groups(survivor), 10.0)
    hung.set()
    assert not box["alive"]
    assert "did not finish its queued work within 1 s" in str(box.get("error")), box


def test_a_healthy_survivor_leaves_the_old_world(survivor) -> None:
    rejoin._destroy_groups(survivor)
    assert not dist.is_initialized()
    assert survivor.calls == ["mpu destroyed"] and survivor.optimizer.pair_group is None


def test_on_npu_each_hccl_communicator_is_released_as_torch_npus_reinit_does(
        survivor, monkeypatch) -> None:
    """D12: torch_npu's reinit_process_group(rebuild_link=True) releases the communicator with
    abort_hccl_comm before a new one is built; the recovery does the same, then builds its new
    world on the recovery's store (docs/stack.md says why not the rest of reinit)."""
    log: List[str] = []

    class Hccl:
        group_name = "dp"

        def name(self) -> str:
            return "hccl"

        def abort_hccl_comm(self, reason: str) -> None:
            log.append(f"abort_hccl_comm({reason}) initialized={dist.is_initialized()}")

    monkeypatch.setattr(abort, "_all_groups", lambda: [Hccl()])
    monkeypatch.setattr(device_copy.STOP, "run", lambda *a, **k: abort.AbortReport(
        (abort.GroupAbort("dp", "hccl", abort.ABORTED, "by the stop of npu:0"),),
        "npu:0 stopped and restarted", False, 0.1))
    rejoin._destroy_groups(survivor)
    assert log == ["abort_hccl_comm(ttp: fault) initialized=True"]
    assert not dist.is_initialized()
