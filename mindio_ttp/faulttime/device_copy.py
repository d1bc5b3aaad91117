"""Reading device memory for the dying checkpoint without the training stream.

The problem: a survivor's main thread is usually stuck in a collective with the dead peer.
On CUDA/NPU that means an NCCL/HCCL kernel that never finishes is in the device queue, and
after ``work.wait()`` the training (default) stream waits for it. Any device-to-host copy the
save handler enqueues on that stream (``tensor.cpu()`` does, in the thread's current stream)
queues behind the hung kernel: the save never finishes and the dying checkpoint is lost.

Two ways out, and the one chosen (facts from the research notes on accelerators and recovery):

1. **Abort the training process groups first** (what NVRx's in-process restart does: abort
   every group in parallel threads, destroy them, pause the watchdog), which removes the hung
   kernel, then read on any stream. Costs: several communicators must be aborted together in
   one ``ncclGroupStart/End`` or one abort's device synchronisation blocks on another hung
   communicator (pytorch #119797); plain ``ncclCommAbort`` can hang in NCCL's proxy thread in
   some versions (nccl #1013, #1777; pytorch #119215), and a hang there is exactly the failure
   we must not add; it needs a per-backend code path (HCCL has its own, MindSpeed uses
   ``torch_npu.npu.stop_device``); and the groups are then gone, so the rank can never rejoin
   in-process.
2. **Copy on a private stream** ordered after an event recorded when the state was last
   consistent. **Chosen**: it touches no communicator, so it cannot hang in an abort; it is
   the same few calls on CUDA and NPU (``torch.cuda`` / ``torch.npu`` both have ``Stream``,
   ``Event``, ``stream()``); the hung kernel runs on its own NCCL stream, and torch's pool
   streams are created non-blocking, so the copy does not wait for it.

What the private stream does not do, and who does it instead:

* The NCCL watchdog: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at torch's default 3 (kill the
  process without abort) the survivor is killed when the group's timeout
  (``--distributed-timeout-minutes``) expires, private stream or not. The launcher sets the
  NCCL/HCCL settings and warns when that timeout is shorter than ``TTP_OT``.
* ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron sets it for sequence-parallel overlap) maps every
  stream onto one hardware work queue, so independent streams can be serialised behind each
  other (a false dependency). Whether a D2H copy on a private stream then still passes a
  blocked kernel is not a documented fact: ``bench/gpu_check.py`` measures it with
  ``torch.cuda._sleep`` blocking the default stream, with that setting and without. It has not
  yet been run on a GPU; until it has, this path is unmeasured there.
* A kernel *before* the event that never finishes (the update itself waits on a hung kernel)
  leaves the state inconsistent anyway: `reading` waits at most ``DEVICE_READY_TIMEOUT_S`` for
  the event and then raises a clear error instead of hanging the save.

How it works:

* `MARK` (one per process): ``ttp_end_updating_os`` records a device event on the training
  stream *before* it publishes the step (hooks.py), so a save of that step, started by the
  controller after reading the step, always finds the event of the update it saves. On a rank
  without a device nothing is recorded (one attribute test per step).
* `reading()`: the context every checkpoint write runs in
  (`mindio_ttp.faulttime.checkpoint_writer`): it waits (bounded, by polling) for the event, orders a
  private stream after it and makes that stream current for the handler thread. torch.save moves
  each non-CPU storage to the host with ``storage.cpu()`` on the current stream, one storage at a
  time, and writes it before the next: the host staging is bounded by one tensor, not by one file.
* `DeviceReader.to_host(tensor)`: the same ordering for code that needs a host copy of one
  tensor (e.g. for a gloo exchange), into one reused pinned staging buffer the size of the
  largest tensor read so far. (torch's own ``use_pinned_memory_for_d2h`` save option is not
  used: it is process-wide, and it allocates a fresh pinned buffer per storage through the
  caching host allocator, which keeps every size it saw: pinned host memory the size of the
  file.)

The runtime never imports torch: the device module is found in ``sys.modules`` (device.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator, Optional

from mindio_ttp import config
from mindio_ttp.faulttime.device import DeviceBinding, _module

log = logging.getLogger("mindio_ttp.processor")


class DeviceNotReady(RuntimeError):
    """The state of the step to save never completed on the device."""


class ReadyMark:
    """The device event recorded at the end of the last optimizer update (see module doc)."""

    def __init__(self) -> None:
        self.module: Optional[Any] = None  # torch.cuda / torch.npu, or None: no device
        self.index = -1
        self.event: Optional[Any] = None
        self.step: Optional[int] = None

    def install(self, binding: DeviceBinding, module: Optional[Any] = None) -> None:
        """Arm the mark for the device the save handler will bind (none: stays a no-op).
        Called in the thread that set the device (the event belongs to it); a device module
        that cannot make an event leaves the mark disarmed, with a warning, instead of failing
        the first training step."""
        self.module, self.index, self.event, self.step = None, binding.index, None, None
        module = module if module is not None else _module(binding.kind)
        if module is None:
            return
        try:
            self.event = module.Event()
        except Exception as exc:  # noqa: BLE001 - a broken driver must not stop registration
            log.warning("cannot create a %s event (%s): the dying checkpoint will read device "
                        "memory on the training stream", binding.describe(), exc)
            return
        self.module = module

    def record(self, step: int) -> None:
        """Hot path (every step, training's thread and stream): record the event."""
        if self.module is None:
            return
        try:
            self.event.record()  # on the calling thread's current stream: the training stream
        except Exception as exc:  # noqa: BLE001 - never fail a training step for the mark
            log.warning("cannot record the end-of-update event (%s): the dying checkpoint "
                        "will read device memory on the training stream", exc)
            self.module = self.event = None
            return
        self.step = step

    def reset(self) -> None:
        self.__init__()


MARK = ReadyMark()


def _pinned(nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class DeviceReader:
    """Reads device memory on a private stream ordered after `mark`'s event (module doc)."""

    def __init__(self, mark: ReadyMark, timeout_s: float = config.DEVICE_READY_TIMEOUT_S,
                 alloc: Callable[[int], Any] = _pinned) -> None:
        if mark.module is None:
            raise ValueError("DeviceReader needs an armed ReadyMark (a device is present)")
        self._mark, self._timeout_s, self._alloc = mark, timeout_s, alloc
        self._module = mark.module
        self._stream: Optional[Any] = None
        self._staging: Optional[Any] = None  # reused: grows to the largest tensor read

    @property
    def staging_bytes(self) -> int:
        return 0 if self._staging is None else int(self._staging.numel())

    def stream(self) -> Any:
        if self._stream is None:
            self._stream = self._module.Stream(device=self._mark.index)
        return self._stream

    def wait_ready(self) -> None:
        """Order the private stream after the mark's event, after waiting (bounded) for it."""
        event = self._mark.event
        if event is None or self._mark.step is None:
            return  # no update has run in this process: nothing in flight to wait for
        deadline = time.monotonic() + self._timeout_s
        pause = 0.0005
        while not event.query():
            if time.monotonic() >= deadline:
                raise DeviceNotReady(
                    f"the optimizer update of step {self._mark.step} did not finish on the "
                    f"device within {self._timeout_s:g} s (a kernel before it hangs): not "
                    "saving a state that may be half-updated")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self.stream().wait_event(event)

    @contextlib.contextmanager
    def reading(self) -> Iterator[Any]:
        """Make the private stream current for this thread, after the mark's event."""
        self.wait_ready()
        stream = self.stream()
        with self._module.stream(stream):
            try:
                yield stream
            finally:
                stream.synchronize()  # every copy issued inside is complete on leaving

    def to_host(self, tensor: Any) -> Any:
        """A host tensor equal to `tensor`, valid until the next call (it lives in the reused
        staging buffer: ``clone()`` it to keep it)."""
        src = tensor.detach().contiguous()
        nbytes = src.numel() * src.element_size()
        with self.reading():  # first: nothing is allocated for a state that is not ready
            if self._staging is None or self._staging.numel() < nbytes:
                self._staging = None  # free the smaller buffer before taking the larger one
                self._staging = self._alloc(max(nbytes, 1))
            out = self._staging[:nbytes].view(src.dtype).view(src.shape)
            out.copy_(src, non_blocking=True)
        return out


_READERS = threading.local()


def reading() -> contextlib.AbstractContextManager:
    """The context a checkpoint write runs in: a private, ordered stream on a device; nothing
    (a null context) on a rank without one. One reader (and stream) per handler thread."""
    if MARK.module is None:
        return contextlib.nullcontext()
    reader = getattr(_READERS, "reader", None)
    if reader is None or reader._mark is not MARK or reader._module is not MARK.module:
        reader = _READERS.reader = DeviceReader(MARK)
    return reader.reading()
