"""A fake accelerator: streams that complete their work later than the host call that enqueued
it, in order, as a device runs its streams (CPU tensors and gloo never show this).

Each `FakeStream` is an in-order queue of work items. Normally every stream has a work queue
(and a thread) of its own; with ``one_queue`` every stream shares one, as
``CUDA_DEVICE_MAX_CONNECTIONS=1`` may make a GPU behave (one hardware queue for every stream, so
an item of any stream waits behind everything enqueued before it, on any stream).

``Event.record()`` enqueues a marker on the calling thread's current stream and ``query()``
says whether the stream has passed it (an event never recorded counts as complete, as on
CUDA); ``Stream.wait_event`` enqueues a wait; ``synchronize`` waits for the stream (or, on the
module, for every stream). `host_read` is what a host read of device memory does (``.item()``,
``bool(t)``, ``torch.save`` of a device tensor): a copy on the current stream, waited for.

The module `FakeDevice` answers the calls the runtime makes on ``torch.cuda`` / ``torch.npu``
(mindio_ttp/faulttime/device.py looks at ``torch.npu`` first); the model stays on the CPU.
Used by the NCCL-like backend (collectives put their completion on these streams) and by
``testkit/hooks/fake_device``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from typing import Callable, Deque, Iterator, Optional


class WorkQueue:
    """One hardware work queue: its items run one after the other on one thread; an item
    that never returns stops the queue for good, as a spinning kernel does."""

    def __init__(self, name: str) -> None:
        self._items: Deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._pending = 0
        threading.Thread(target=self._run, name=f"fake-device-{name}", daemon=True).start()

    def put(self, item: Callable[[], None]) -> None:
        with self._cond:
            self._pending += 1
            self._items.append(item)
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return self._pending == 0

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._items))
                item = self._items.popleft()
            try:
                item()
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()


class FakeStream:
    """An in-order stream of device work (see the module doc)."""

    def __init__(self, name: str, queue: Optional[WorkQueue] = None) -> None:
        self.name = name
        self._queue = queue if queue is not None else WorkQueue(name)
        self._idle = threading.Condition()
        self._pending = 0
        _STREAMS.add(self)

    def enqueue(self, fn: Callable[[], object]) -> None:
        with self._idle:
            self._pending += 1

        def item() -> None:
            try:
                fn()
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

        self._queue.put(item)

    def wait_event(self, event: FakeEvent) -> None:
        self.enqueue(event.passed.wait)  # the event as recorded now, not a later record

    def synchronize(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def query(self) -> bool:
        with self._idle:
            return self._pending == 0

    def host_read(self) -> None:
        """A device-to-host copy on this stream, waited for: returns once everything this
        stream's queue held before it ran (immediately when that queue is idle)."""
        if self._queue.idle():
            return
        done = threading.Event()
        self.enqueue(done.set)
        done.wait()

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"


class FakeEvent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.passed = threading.Event()
        self.passed.set()  # an event never recorded counts as complete, as on CUDA

    def record(self, stream: Optional[FakeStream] = None) -> None:
        passed = threading.Event()
        self.passed = passed
        (stream or current_stream()).enqueue(passed.set)

    def query(self) -> bool:
        return self.passed.is_set()

    def synchronize(self) -> None:
        self.passed.wait()

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        (stream or current_stream()).wait_event(self)


_STREAMS: weakref.WeakSet[FakeStream] = weakref.WeakSet()
_local = threading.local()
_shared: Optional[WorkQueue] = None  # the one queue, in one-queue mode
DEFAULT = FakeStream("default")


def set_one_queue(on: bool) -> None:
    """Every stream made from now on (and the default stream) shares one work queue."""
    global _shared, DEFAULT
    if on and _shared is None:
        _shared = WorkQueue("one-queue")
        DEFAULT = FakeStream("default", _shared)


def new_stream(name: str) -> FakeStream:
    return FakeStream(name, _shared)


def current_stream() -> FakeStream:
    return getattr(_local, "stream", None) or DEFAULT


def synchronize_all() -> None:
    for stream in list(_STREAMS):
        stream.synchronize()


class FakeDevice:
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
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(index: int) -> None:
        pass

    @staticmethod
    def Stream(device: int = 0, priority: int = 0) -> FakeStream:  # noqa: N802 - torch's name
        return new_stream(f"private-{device}")

    @staticmethod
    def current_stream(device: int = 0) -> FakeStream:
        return current_stream()

    @staticmethod
    def default_stream(device: int = 0) -> FakeStream:
        return DEFAULT

    @staticmethod
    def synchronize(device: int = 0) -> None:
        synchronize_all()

    @staticmethod
    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[FakeStream]:
        previous = getattr(_local, "stream", None)
        _local.stream = s
        try:
            yield s
        finally:
            _local.stream = previous
