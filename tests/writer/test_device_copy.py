"""device_copy on CPU: the no-device path is a no-op, and the device path's ordering (event at
the end of the update, private stream after it, copies inside, staging reused; the param
all-gather's event, noted before the abort and never after) is checked against a recording fake
of the ``torch.cuda`` / ``torch.npu`` stream API whose events complete when the test says."""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

from mindio_ttp.control import hooks
from mindio_ttp.faulttime import abort, checkpoint_writer, device, device_copy
from mindio_ttp.faulttime.device import NO_DEVICE, DeviceBinding


class FakeEvent:
    def __init__(self, log: List[str], ready_after: int) -> None:
        self.log, self.ready_after, self.queries = log, ready_after, 0

    def record(self) -> None:
        self.log.append(f"record(step published={hooks.STATE.step})")

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.ready_after


class FakeStream:
    def __init__(self, log: List[str], device: int) -> None:
        self.log, self.device = log, device

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append("private.wait_event")

    def synchronize(self) -> None:
        self.log.append("private.synchronize")


class FakeDeviceModule:
    """The calls device_copy makes on torch.cuda / torch.npu, recorded in order."""

    def __init__(self, ready_after: int = 2) -> None:
        self.log: List[str] = []
        self.ready_after = ready_after
        self.current = "default"
        self.events: List[FakeEvent] = []

    def Event(self) -> FakeEvent:  # noqa: N802 - the torch name
        self.events.append(FakeEvent(self.log, self.ready_after))
        return self.events[-1]

    def Stream(self, device: int) -> FakeStream:  # noqa: N802
        self.log.append(f"Stream(device={device})")
        return FakeStream(self.log, device)

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        self.log.append("enter private")
        self.current = "private"
        try:
            yield
        finally:
            self.current = "default"
            self.log.append("exit private")


@pytest.fixture
def fake() -> Iterator[FakeDeviceModule]:
    module = FakeDeviceModule()
    device_copy.MARK.install(DeviceBinding("cuda", 3), module=module)
    hooks.STATE.reset()
    try:
        yield module
    finally:
        device_copy.MARK.reset()
        device_copy._READERS.__dict__.clear()
        hooks.STATE.reset()


def test_without_a_device_nothing_is_recorded_and_reading_is_a_null_context(
        tmp_path: Path) -> None:
    device_copy.MARK.install(NO_DEVICE)
    hooks.end_updating_os(4)
    hooks.STATE.reset()
    assert device_copy.MARK.event is None and device_copy.MARK.step is None
    assert isinstance(device_copy.reading(), contextlib.nullcontext)
    with pytest.raises(ValueError, match="armed ReadyMark"):
        device_copy.DeviceReader(device_copy.MARK)
    written = checkpoint_writer.write_torch(tmp_path / "x.pt", {"a": torch.ones(3)})
    assert written.size == (tmp_path / "x.pt").stat().st_size


def test_end_updating_os_records_the_event_before_it_publishes_the_step(fake) -> None:
    hooks.end_updating_os(1)
    hooks.end_updating_os(2)
    assert fake.log == ["record(step published=None)", "record(step published=1)"]
    assert len(fake.events) == 1  # one event, re-recorded each step: nothing allocated per step
    assert device_copy.MARK.step == 2


def test_a_write_runs_on_the_private_stream_after_waiting_for_the_event(fake,
                                                                        tmp_path: Path) -> None:
    hooks.end_updating_os(7)
    seen = []
    checkpoint_writer.write_torch(tmp_path / "x.pt", {"a": torch.randn(1000)},
                                  midway=lambda: seen.append(fake.current))
    assert seen == ["private"]  # torch.save wrote (and would have staged) inside
    assert fake.log == ["record(step published=None)", "Stream(device=3)",
                        "private.wait_event", "enter private", "private.synchronize",
                        "exit private"]
    assert fake.events[0].queries == fake.ready_after + 1  # polled until the update finished


def test_to_host_copies_inside_the_private_stream_into_one_reused_buffer(fake) -> None:
    hooks.end_updating_os(1)
    sizes = []

    def alloc(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    reader = device_copy.DeviceReader(device_copy.MARK, alloc=alloc)
    big, small = torch.randn(1000), torch.arange(10, dtype=torch.int64).view(2, 5)
    out = reader.to_host(big)
    assert torch.equal(out, big)
    ptr = out.data_ptr()
    out = reader.to_host(small)
    assert torch.equal(out, small) and out.shape == (2, 5)
    assert out.data_ptr() == ptr  # the same staging memory
    assert sizes == [4000] and reader.staging_bytes == 4000  # bounded by the largest tensor
    out = reader.to_host(torch.randn(2000))
    assert sizes == [4000, 8000]
    assert fake.log.count("Stream(device=3)") == 1  # one private stream for the reader
    per_copy = ["private.wait_event", "enter private", "private.synchronize", "exit private"]
    assert fake.log[2:] == per_copy * 3


def test_an_update_that_never_finishes_on_the_device_is_refused_not_waited_for(
        fake, tmp_path: Path) -> None:
    fake.events[0].ready_after = 10**9
    hooks.end_updating_os(5)
    reader = device_copy.DeviceReader(device_copy.MARK, timeout_s=0.2)
    with pytest.raises(device_copy.DeviceNotReady, match="step 5 did not finish"):
        reader.to_host(torch.ones(4))
    device_copy._READERS.reader = reader
    with pytest.raises(device_copy.DeviceNotReady):
        checkpoint_writer.write_torch(tmp_path / "x.pt", {"a": torch.ones(4)})
    assert list(tmp_path.iterdir()) == [tmp_path / "x.pt.part"]  # nothing complete-looking


def test_a_device_module_without_working_events_leaves_training_untouched(caplog) -> None:
    class NoEvents(FakeDeviceModule):
        def Event(self):  # noqa: N802
            raise RuntimeError("driver says no")

    try:
        device_copy.MARK.install(DeviceBinding("cuda", 0), module=NoEvents())
        assert device_copy.MARK.module is None and "cannot create a cuda:0 event" in caplog.text
        hooks.end_updating_os(3)  # the step still ends normally
        assert hooks.STATE.step == 3
        assert isinstance(device_copy.reading(), contextlib.nullcontext)
        module = FakeDeviceModule()
        device_copy.MARK.install(DeviceBinding("cuda", 0), module=module)
        module.events[0].record = lambda: (_ for _ in ()).throw(RuntimeError("lost device"))
        hooks.end_updating_os(4)
        assert hooks.STATE.step == 4 and device_copy.MARK.module is None
        assert "cannot record the end-of-update event" in caplog.text
    finally:
        device_copy.MARK.reset()
        hooks.STATE.reset()


# -- the param all-gather's event, and what prepare() does before any read ---------------------

class FakeFuture:
    def __init__(self, value: int) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def value(self) -> int:
        return self._value


class FakeWork:
    def __init__(self, result: int) -> None:
        self.result = result

    def get_future_result(self) -> FakeFuture:
        return FakeFuture(self.result)


@pytest.fixture
def gathered() -> Iterator[device_copy.GatherMark]:
    device_copy.GATHERED.reset()
    try:
        yield device_copy.GATHERED
    finally:
        device_copy.GATHERED.reset()


def test_without_a_device_the_params_of_the_last_gathered_step_count(gathered) -> None:
    device_copy.MARK.install(NO_DEVICE)
    gathered.record(4)
    assert gathered.done_at(4) and not gathered.done_at(5)


def test_on_a_device_the_params_count_only_once_their_event_completed(fake, gathered) -> None:
    gathered.record(4, [FakeWork(0)])
    event = gathered.event
    assert event is not None and "record(step published=None)" in fake.log
    event.ready_after = 10**9  # the all-gather (and the copies behind it) still runs
    assert not gathered.done_at(4)
    event.ready_after = 0
    assert gathered.done_at(4) and not gathered.done_at(3)


def test_a_gather_that_ended_in_error_never_counts_even_with_its_event_complete(
        fake, gathered) -> None:
    """A watchdog abort ends the all-gather early: the copies behind it run on torn data and
    the event after them completes; the work's result says what happened."""
    gathered.record(6, [FakeWork(0), FakeWork(2)])  # WorkResult.COMM_ERROR
    gathered.event.ready_after = 0
    assert not gathered.done_at(6)


def test_prepare_notes_what_the_device_finished_before_it_aborts(fake, gathered,
                                                                  monkeypatch) -> None:
    hooks.end_updating_os(5)
    gathered.record(5)
    gathered.event.ready_after = 10**9  # hung behind a dead peer's all-gather
    seen = []

    def abort_all(timeout_s, binding):
        seen.append(("abort", binding, gathered.event.queries))
        gathered.event.ready_after = 0  # the abort ends the hung kernel: everything completes
        return abort.AbortReport((), "", False, 0.0)

    monkeypatch.setattr(abort, "abort_all", abort_all)
    ready = device_copy.prepare(5, ready_timeout_s=2.0)
    assert seen and seen[0][1] == DeviceBinding("cuda", 3) and seen[0][2] >= 1
    assert ready.gathered is False  # noted before the abort, never after
    assert gathered.done_at(5)  # what a check after the abort would (wrongly) have said


def test_prepare_refuses_an_update_that_never_finishes_before_aborting(fake, monkeypatch) -> None:
    fake.events[0].ready_after = 10**9
    hooks.end_updating_os(5)
    monkeypatch.setattr(abort, "abort_all", lambda *a, **k: pytest.fail("aborted anyway"))
    with pytest.raises(device_copy.DeviceNotReady, match="step 5 did not finish"):
        device_copy.prepare(5, ready_timeout_s=0.2)


def test_reading_the_live_params_also_waits_for_their_gather(fake, gathered,
                                                              tmp_path: Path) -> None:
    hooks.end_updating_os(2)
    gathered.record(2)
    checkpoint_writer.write_torch(tmp_path / "m.pt", {"w": torch.ones(2)}, live_params=True)
    assert fake.log.count("private.wait_event") == 2  # the update's event and the gather's
    checkpoint_writer.write_torch(tmp_path / "o.pt", {"w": torch.ones(2)})
    assert fake.log.count("private.wait_event") == 3  # optimizer state: the update's only


def test_the_private_stream_is_torch_npus_sync_launch_stream_on_npu(monkeypatch) -> None:
    made = []
    npu = types.SimpleNamespace(SyncLaunchStream=lambda i: made.append(i) or f"sync-{i}")
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    module = FakeDeviceModule()
    assert device.private_stream(module, DeviceBinding("npu", 2)) == "sync-2"
    assert made == [2] and "Stream(device=2)" not in module.log


def test_a_cuda_stream_outside_the_pool_falls_back_to_the_pool_with_a_warning(caplog) -> None:
    class WithExternal(FakeDeviceModule):
        def ExternalStream(self, ptr, device):  # noqa: N802
            raise AssertionError("no CUDA runtime here: never reached")

        @contextlib.contextmanager
        def device(self, index):
            raise RuntimeError("no CUDA device")
            yield

    module = WithExternal()
    stream = device.private_stream(module, DeviceBinding("cuda", 1))
    assert isinstance(stream, FakeStream) and module.log == ["Stream(device=1)"]
    assert "outside torch's pool" in caplog.text
