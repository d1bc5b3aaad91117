"""Test-only: a fake accelerator in each worker, whose work completes later than the host call
that enqueued it returns (what NCCL/HCCL do, and what a CPU/gloo run never shows).

Put this folder first on PYTHONPATH and set ``TTP_FAKE_DEVICE=1``. The worker gets a device
module as ``torch.npu`` (the runtime looks there first, mindio_ttp/faulttime/device.py) whose
streams are in-order queues, each run by its own thread, as a device runs its streams:
``Event.record()`` enqueues a marker on the calling thread's current stream and ``query()`` says
whether the stream has passed it; ``Stream.wait_event`` enqueues a wait; ``synchronize`` waits
for the queue. The model stays on the CPU: only the runtime's events and streams are on the
fake device.

``TTP_FAKE_DEVICE_HANG_GATHER=K``: in iteration K (Megatron's 1-based number) every
``torch.distributed._all_gather_base`` of the training thread is enqueued on the default stream
instead of run, and the stream hangs there, as behind an NCCL all-gather whose peer died inside
it: the host call returns at once, the copies that follow on the host read a buffer that never
received the gather, and nothing enqueued behind it completes (the event the optimizer records
after its copies included). Combine with a fault plan that kills a rank in that iteration
(``R:K:sigkill:after``): the survivors are then stopped by the fault flow. The fault injector of
``../fault_hook`` still runs (this file executes it first).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from pathlib import Path

from testkit.import_hooks import after_import, run_hook_file

_HERE = Path(__file__).resolve().parent


class FakeStream:
    """One in-order queue of device work, run by its own thread."""

    def __init__(self, name: str) -> None:
        self._todo: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        threading.Thread(target=self._run, name=f"fake-device-{name}", daemon=True).start()

    def enqueue(self, fn) -> None:
        with self._idle:
            self._pending += 1
        self._todo.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._todo.get()
            fn()  # a hung item hangs this stream for good, as on a device
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def wait_event(self, event: FakeEvent) -> None:
        self.enqueue(event.passed.wait)

    def synchronize(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def query(self) -> bool:
        with self._idle:
            return self._pending == 0


class FakeEvent:
    def __init__(self) -> None:
        self.passed = threading.Event()
        self.passed.set()  # an event never recorded counts as complete, as on CUDA

    def record(self, stream: FakeStream = None) -> None:
        passed = threading.Event()
        self.passed = passed
        (stream or _current()).enqueue(passed.set)

    def query(self) -> bool:
        return self.passed.is_set()

    def synchronize(self) -> None:
        self.passed.wait()


_local = threading.local()
DEFAULT = FakeStream("default")


def _current() -> FakeStream:
    return getattr(_local, "stream", DEFAULT)


class FakeDeviceModule:
    """The calls the runtime makes on torch.cuda / torch.npu."""

    Event = FakeEvent

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(index: int) -> None:
        pass

    @staticmethod
    def Stream(device: int = 0) -> FakeStream:  # noqa: N802 - torch's name
        return FakeStream(f"private-{device}")

    @staticmethod
    def current_stream(device: int = 0) -> FakeStream:
        return _current()

    @staticmethod
    @contextlib.contextmanager
    def stream(s: FakeStream):
        previous = _current()
        _local.stream = s
        try:
            yield s
        finally:
            _local.stream = previous


class _EnqueuedWork:
    """What an NCCL call returns once enqueued: wait() only orders the current stream."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return False


def _hang_gathers_in(iteration: int) -> None:
    import torch

    real = torch.distributed._all_gather_base
    hung = threading.Event()  # never set: the peer died inside the all-gather
    training = threading.main_thread()

    def all_gather_base(*args, **kwargs):
        megatron = __import__("sys").modules.get("megatron")
        now = getattr(megatron.get_args(), "curr_iteration", -1) + 1 if megatron else -1
        if threading.current_thread() is not training or now != iteration:
            return real(*args, **kwargs)
        print(f"fake device: the param all-gather of iteration {iteration} is enqueued and "
              "hangs on the device", flush=True)
        DEFAULT.enqueue(hung.wait)
        return _EnqueuedWork() if kwargs.get("async_op") else None

    torch.distributed._all_gather_base = all_gather_base


def _install() -> None:
    if os.environ.get("TTP_FAKE_DEVICE") != "1":
        return

    def install(torch) -> None:
        torch.npu = FakeDeviceModule()
        hang = os.environ.get("TTP_FAKE_DEVICE_HANG_GATHER")
        if hang:
            _hang_gathers_in(int(hang))

    after_import("torch", install)


run_hook_file(str(_HERE.parent / "fault_hook" / "sitecustomize.py"))
_install()
