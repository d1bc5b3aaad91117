"""device_copy on CPU: the no-device path is a no-op, and the device path's ordering (event at
the end of the update, private stream after it, copies inside, staging reused; the param
all-gather's event, noted before the abort and never after) is checked against a recording fake
of the ``torch.cuda`` / ``torch.npu`` stream API whose events complete when the test says."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

from mindio_ttp import config, hooks
from mindio_ttp.faulttime import abort, checkpoint_writer, device, device_copy
from mindio_ttp.faulttime.device import NO_DEVICE, DeviceBinding


class FakeEvent:
    def __init__(self, log: List[str], ready_after: int) -> None:
        self.log, self.ready_after, self.queries = log, ready_after, 0

    def record(self, stream: FakeStream = None) -> None:
        if stream is not None:  # the read's probe, on the private stream
            self.log.append("private.record")
            return
        self.log.append(f"record(step published={hooks.STATE.step})")

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.ready_after


class FakeStream:
    def __init__(self, log: List[str], device: int) -> None:
        self.log, self.device = log, device

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append("private.wait_event")

    def synchronize(self) -> None:  # never called: a blocking wait could hang for good
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


def _fresh_marks() -> None:
    """A new fault: the stop not run, GATHERED and OFFERED empty (the code before the stop
    existed had GATHERED alone: these tests also run against it, to show they fail there)."""
    stop = getattr(device_copy, "STOP", None)
    (stop.reset if stop is not None else device_copy.GATHERED.reset)()


@pytest.fixture
def fake() -> Iterator[FakeDeviceModule]:
    module = FakeDeviceModule()
    device_copy.MARK.install(DeviceBinding("cuda", 3), module=module)
    hooks.STATE.reset()
    _fresh_marks()
    try:
        yield module
    finally:
        device_copy.MARK.reset()
        _fresh_marks()
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
                        "private.wait_event", "private.record", "enter private",
                        "private.record", "exit private"]  # polled probes, never a blocking wait
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
    per_copy = ["private.wait_event", "private.record", "enter private", "private.record",
                "exit private"]
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
    _fresh_marks()
    try:
        yield device_copy.GATHERED
    finally:
        _fresh_marks()


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
    assert gathered.event.query()  # what a check after the abort would (wrongly) have read
    assert not gathered.done_at(5)  # latched: every later question gets the note


def test_a_second_save_attempt_reads_the_note_not_the_event_the_abort_completed(
        fake, gathered, monkeypatch) -> None:
    """D2: a kept saver ordered again (a second saver died mid-save), or a standby's re-run of
    the flow, calls prepare() again in the same process. The first attempt's abort ended the
    hung all-gather; the copies behind it ran on half-received buffers and the event completed.
    Trusting it wrote gradient values as weights, with a valid sha256."""
    hooks.end_updating_os(5)
    gathered.record(5)
    gathered.event.ready_after = 10**9
    calls = []

    def abort_all(timeout_s, binding):
        calls.append("abort")
        gathered.event.ready_after = 0
        return abort.AbortReport((), "", False, 0.0)

    monkeypatch.setattr(abort, "abort_all", abort_all)
    first = device_copy.prepare(5, ready_timeout_s=2.0)
    second = device_copy.prepare(5, ready_timeout_s=2.0)
    assert first.gathered is False and second.gathered is False
    assert calls == ["abort"]  # one abort per fault: the second attempt gets its report


class LegacyWork:
    """A Work of torch < 2.6: no get_future_result; the watchdog sets exception()."""

    def __init__(self, error: Exception = None) -> None:
        self.error = error

    def exception(self):
        return self.error


def test_without_get_future_result_a_works_exception_says_the_gather_failed(
        fake, gathered) -> None:
    """D9: before torch 2.6 there is no get_future_result; a watchdog abort of the all-gather
    (an NCCL async error) went unseen and the torn live params were saved."""
    gathered.record(6, [LegacyWork(), LegacyWork(RuntimeError("NCCL error: remote process "
                                                              "exited"))])
    gathered.event.ready_after = 0
    assert not gathered.done_at(6)
    gathered.record(7, [LegacyWork(), LegacyWork()])
    assert gathered.done_at(7)


def test_a_failed_abort_with_one_work_queue_refuses_the_read_at_once(fake, monkeypatch) -> None:
    """D5: with CUDA_DEVICE_MAX_CONNECTIONS=1 a read after a failed abort queues behind the
    hung kernel, with no bound short of the save's time limit: refuse at once instead."""
    hooks.end_updating_os(5)
    failed = abort.AbortReport((abort.GroupAbort("dp", "nccl", abort.TIMED_OUT, "after 10 s"),),
                               "", False, 10.0)
    monkeypatch.setattr(abort, "abort_all", lambda timeout_s, binding: failed)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(device_copy.FallbackUnsafe, match="one hardware queue"):
        device_copy.prepare(5, ready_timeout_s=1.0)
    _fresh_marks()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # several queues: the read goes on
    assert device_copy.prepare(5, ready_timeout_s=1.0).abort is failed


def test_a_read_stuck_behind_a_hung_kernel_is_given_up_within_its_bound(
        fake, monkeypatch, tmp_path: Path) -> None:
    """D5: the private stream cannot pass a kernel the abort did not end; the read gives up
    after FALLBACK_PROBE_S instead of blocking (the stream's synchronize would never return)."""
    hooks.end_updating_os(5)
    hung = threading.Event()  # never set: the stream never drains
    monkeypatch.setattr(FakeStream, "synchronize", lambda self: hung.wait())
    real_event = fake.Event

    def stuck_event():
        event = real_event()
        event.ready_after = 10**9 if len(fake.events) > 1 else event.ready_after
        return event

    monkeypatch.setattr(fake, "Event", stuck_event)
    monkeypatch.setattr(config, "FALLBACK_PROBE_S", 0.3)
    box = {}

    def write() -> None:
        try:
            checkpoint_writer.write_torch(tmp_path / "x.pt", {"a": torch.ones(4)})
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            box["error"] = exc

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    thread.join(5.0)
    hung.set()
    assert not thread.is_alive(), "the read blocked past its bound"
    assert isinstance(box.get("error"), device_copy.DeviceNotReady), box
    assert "did not reach the state to read within 0.3 s" in str(box["error"])


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


def test_a_forked_child_starts_with_its_own_stop(gathered) -> None:
    """Its parent's abort report and note are not the child's: it aborted nothing."""
    import os

    device_copy.MARK.install(NO_DEVICE)
    gathered.record(4)
    device_copy.STOP.run(timeout_s=1.0)
    assert device_copy.STOP.ran and gathered.latched
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, then leave at once
        os.write(w, b"%d%d" % (device_copy.STOP.ran, device_copy.GATHERED.latched))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 2) == b"00"
