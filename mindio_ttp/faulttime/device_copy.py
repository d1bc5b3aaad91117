"""Reading device memory for the dying checkpoint: stop the device's work, then read on a stream
no collective shares, ordered after the state it reads.

The problem: a survivor's main thread is usually stuck in a collective with the dead peer. On
CUDA/NPU an NCCL/HCCL kernel that never finishes is in the device queue, and after
``work.wait()`` the training (default) stream waits for it. A device-to-host copy on that
stream (``tensor.cpu()`` copies on the thread's current stream) queues behind it forever.

The design (docs/design.md, "Reading device memory after a fault", says why each step rests on
documented behaviour only), in the order `prepare` runs it:

1. **What the device finished, noted before anything is aborted.** `MARK` is an event recorded
   on the training stream by ``ttp_end_updating_os`` after the optimizer update of the step;
   `GATHERED` an event recorded by ``ReplicatedOptimizer.gather_model_params`` after its param
   all-gather and the copies into the live params. Both are read *before* the abort: an abort
   ends a hung collective early, the kernels queued behind it then run on torn data and their
   events complete too, so a completion seen after an abort proves nothing. The update's event
   is waited for (bounded, ``DEVICE_READY_TIMEOUT_S``: a device that is merely busy finishes it
   in milliseconds; one that does not is hung before the update, and the save refuses instead
   of writing a half-updated state). The gather's event is queried once: on NCCL the host
   returns from the all-gather as soon as it is enqueued, so "the host call returned" says
   nothing about the params; not done means the live params may still hold step t-1 (or a
   torn mix), and the model file is rebuilt from the optimizer's fp32 main params instead.
2. **Abort** every communicator (`abort.abort_all`: NCCL in parallel threads, torch_npu's
   device stop/restart for HCCL, bounded by ``ABORT_TIMEOUT_S``; gloo: nothing). This removes
   the hung kernel, the thing no stream trick is documented to get past
   (``CUDA_DEVICE_MAX_CONNECTIONS=1`` folds all streams onto one hardware queue; torch_npu's
   blocking copies drain the device's single task queue first).
3. **Read on a private stream from outside torch's pool** (`device.private_stream`: a
   cudart-made non-blocking stream wrapped by ``torch.cuda.ExternalStream``; torch_npu's
   ``SyncLaunchStream``), ordered after `MARK` (and after `GATHERED` when the live params are
   read). This is the fallback when an abort timed out or failed, and costs nothing when it
   worked: the copy never waits for the training stream, only for the events it reads after.

`reading()`: the context every checkpoint write runs in (`checkpoint_writer`): it waits
(bounded, by polling) for the mark's event, orders the private stream after it and makes that
stream current for the handler thread. torch.save moves each non-CPU storage to the host with
``storage.cpu()`` on the current stream, one storage at a time, and writes it before the next:
the host staging is bounded by one tensor, not by one file. `DeviceReader.to_host(tensor)`:
the same ordering for one tensor, into one reused pinned staging buffer the size of the
largest tensor read so far (torch's ``use_pinned_memory_for_d2h`` save option is not used: it
is process-wide and allocates a pinned buffer per storage that the caching host allocator
keeps: pinned host memory the size of the file).

Nothing of this is needed, or done, on a rank without a device (one attribute test per step).
``bench/gpu_check.py`` reproduces the hazards on one NVIDIA GPU; it has not yet run on a GPU,
and nothing here has run on an NPU.

The runtime never imports torch: the device module is found in ``sys.modules`` (device.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

from mindio_ttp import config
from mindio_ttp.faulttime import abort
from mindio_ttp.faulttime.device import NO_DEVICE, DeviceBinding, _module, private_stream

log = logging.getLogger("mindio_ttp.processor")


class DeviceNotReady(RuntimeError):
    """The state of the step to save never completed on the device."""


def _poll(event: Any, timeout_s: float, why: Callable[[], str]) -> None:
    """Return once `event` has completed on the device; DeviceNotReady(why()) after
    `timeout_s`. Polling, never a blocking wait: a device that does not get there would hold
    a blocking one for good."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while not event.query():
        if time.monotonic() >= deadline:
            raise DeviceNotReady(why())
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class ReadyMark:
    """The device event recorded at the end of the last optimizer update (see module doc)."""

    def __init__(self) -> None:
        self.module: Optional[Any] = None  # torch.cuda / torch.npu, or None: no device
        self.index = -1
        self.binding: DeviceBinding = NO_DEVICE
        self.event: Optional[Any] = None
        self.step: Optional[int] = None

    def install(self, binding: DeviceBinding, module: Optional[Any] = None) -> None:
        """Arm the mark for the device the save handler will bind (none: stays a no-op).
        Called in the thread that set the device (the event belongs to it); a device module
        that cannot make an event leaves the mark disarmed, with a warning, instead of failing
        the first training step."""
        self.module, self.index, self.event, self.step = None, binding.index, None, None
        self.binding = binding
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

    def wait_done(self, timeout_s: float) -> None:
        """Return once the recorded update finished on the device; DeviceNotReady after
        `timeout_s` (polling: a blocking synchronize could hang for good)."""
        event = self.event
        if self.module is None or event is None or self.step is None:
            return  # no device, or no update in this process: nothing in flight
        _poll(event, timeout_s, lambda: (
            f"the optimizer update of step {self.step} did not finish on the device within "
            f"{timeout_s:g} s (a kernel before it hangs): not saving a state that may be "
            "half-updated"))

    def reset(self) -> None:
        self.__init__()


MARK = ReadyMark()


def _work_failed(work: Any) -> bool:
    """True when a collective's result says it ended in error (a watchdog abort: its kernel
    then ended early, so the copies behind it ran on torn data and the event after them still
    completed). ``get_future_result`` (torch 2.6 on, PR #137799) is the non-deprecated status;
    where it is missing, ``exception()``, which the watchdog sets on the same error (every
    torch binds it on Work). A backend that can answer neither leaves the event as the answer."""
    get = getattr(work, "get_future_result", None)
    if get is not None:
        try:
            future = get()
            return bool(future.done() and int(future.value()) != 0)  # WorkResult.SUCCESS == 0
        except Exception:  # noqa: BLE001 - not supported by this backend (gloo)
            return False
    exception = getattr(work, "exception", None)
    if exception is None:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks it deprecated, in favour of the above
            return exception() is not None
    except Exception:  # noqa: BLE001 - a backend that cannot say
        return False


class GatherMark:
    """The device event recorded after some device work of a step: `GATHERED`, the param
    all-gather and its copies into the live params (module doc, step 1: did the params of step
    t reach the model?); `OFFERED`, the collectives of the update `hooks.offer_update` offers.

    `latch` freezes the answer just before the fault's abort (`FaultStop`): the abort ends a
    hung collective early, the work queued behind it then runs on torn data and the event
    completes, so from then on `done_at` answers what the device had finished before the abort,
    for that step only, however often it is asked (a kept saver's second save attempt, a
    standby's re-run of the flow: D2)."""

    def __init__(self, mark: ReadyMark) -> None:
        self._mark = mark  # its device module: the same device, armed at the same time
        self._latched: Optional[Tuple[Optional[int], bool]] = None
        self.step: Optional[int] = None
        self.event: Optional[Any] = None
        self.works: Tuple[Any, ...] = ()
        self._module: Optional[Any] = None  # the module `event` belongs to
        self._exact = True  # False: a device is there but its event could not be recorded

    def record(self, step: int, works: Iterable[Any] = ()) -> None:
        """Hot path (every step, training's thread and stream), after the copy loop."""
        module = self._mark.module
        self.works, self._exact = tuple(works), True
        if module is None:
            self.event = None  # no device: the host call returned after the data arrived
        else:
            try:
                if self.event is None or self._module is not module:
                    self.event, self._module = module.Event(), module
                self.event.record()  # on the training stream, behind the copies
            except Exception as exc:  # noqa: BLE001 - never fail a training step for the mark
                log.warning("cannot record the param all-gather event (%s): a dying checkpoint "
                            "will rebuild the model file from the main params", exc)
                self.event, self._exact = None, False
        self.step = step

    def latch(self) -> Tuple[Optional[int], bool]:
        """Freeze (step recorded, its work done now) for every later `done_at`; the first call
        decides (class doc)."""
        if self._latched is None:
            step = self.step
            self._latched = (step, step is not None and self._done_now(step))
        return self._latched

    @property
    def latched(self) -> bool:
        return self._latched is not None

    def done_at(self, step: int) -> bool:
        """Whether the work of step `step` is done on the device, as of now or, once latched,
        as of the latch (never waits)."""
        latched = self._latched
        if latched is not None:
            return latched[1] and latched[0] == step
        return self._done_now(step)

    def _done_now(self, step: int) -> bool:
        if self.step != step or not self._exact:
            return False
        if self.event is None:
            return True
        try:
            if not self.event.query():
                return False
        except Exception:  # noqa: BLE001 - a device that cannot answer: assume not
            return False
        return not any(_work_failed(w) for w in self.works)

    def reset(self) -> None:
        self.__init__(self._mark)


GATHERED = GatherMark(MARK)
OFFERED = GatherMark(MARK)


@dataclass(frozen=True)
class FaultRead:
    """What `prepare` found and did before the dying checkpoint reads."""

    gathered: bool  # the live params hold the step (GATHERED), noted before the abort
    abort: abort.AbortReport


class FallbackUnsafe(DeviceNotReady):
    """The abort did not stop the device's work and a read could wait behind the hung kernel
    for good (one hardware queue): this rank refuses to save rather than hang."""


class FaultStop:
    """This process's stop of its device work for one fault, done once: note what the device
    finished (`GATHERED` and `OFFERED` latched), then abort every communicator (`abort_all`).

    Every survivor runs it, not only the savers (a rank whose communicators stay alive can hold
    up its node's aborts: nccl #863), and off the main thread, which may be stuck in the very
    collective the abort ends: the processor's `ttp-fault-stop` thread at the controller's lock
    or recover order, or `prepare` in a save handler, whichever comes first. A second caller
    gets the first one's report (waiting for it, bounded): the latch is taken once, before the
    only abort, so no later call can read "done" from an event the abort completed (D2)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self.report: Optional[abort.AbortReport] = None
        self.started_at: Optional[float] = None  # time.monotonic() of the abort's start

    @property
    def ran(self) -> bool:
        """The stop has started (its report may still be pending)."""
        return self._started

    def run(self, timeout_s: float = config.ABORT_TIMEOUT_S,
            binding: Optional[DeviceBinding] = None,
            before_abort: Callable[[], None] = lambda: None) -> abort.AbortReport:
        """Latch, call `before_abort` (the hooks' fence), abort; or wait for the call that
        did. Never raises for a backend; bounded by `timeout_s` (and as much again for a
        caller that waits for another's)."""
        with self._lock:
            first, self._started = not self._started, True
        if not first:
            if self._done.wait(2 * timeout_s + 1.0) and self.report is not None:
                return self.report
            return abort.AbortReport((abort.GroupAbort(
                "*", "?", abort.TIMED_OUT, "the fault's first abort did not return"),), "",
                False, 2 * timeout_s)
        try:
            GATHERED.latch()
            OFFERED.latch()
            before_abort()
            self.started_at = time.monotonic()
            self.report = abort.abort_all(timeout_s, binding=binding or MARK.binding)
        finally:
            self._done.set()
        return self.report

    def reset(self) -> None:
        """A new world (a recovery destroyed the aborted groups): the next fault stops anew."""
        with self._lock:
            self.__init__()
        GATHERED.reset()
        OFFERED.reset()


STOP = FaultStop()


def _forked() -> None:
    """A forked child aborted nothing: the parent's note and report are not its own. (No lock
    is taken: another thread of the parent may have held one at the fork.)"""
    STOP.__init__()
    GATHERED.reset()
    OFFERED.reset()


os.register_at_fork(after_in_child=_forked)


def one_work_queue() -> bool:
    """Every stream of this process shares one hardware queue: CUDA with
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron requires it; NVIDIA documents the variable only
    as the number of work queues, and nothing promises that a copy on another stream passes a
    kernel hung at the head of the one queue)."""
    return MARK.binding.kind == "cuda" and \
        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"


def prepare(step: int, ready_timeout_s: float = config.DEVICE_READY_TIMEOUT_S,
            abort_timeout_s: float = config.ABORT_TIMEOUT_S) -> FaultRead:
    """Steps 1 and 2 of the module doc, in that order: wait (bounded) for the update of `step`
    on the device, note whether its params reached the model, then abort every communicator
    (`STOP`: done already when the processor stopped this rank at the fault's lock; the note
    is the one latched then). Raises DeviceNotReady when the update never finishes, and
    FallbackUnsafe when the abort failed while one work queue is in force; an abort that fails
    or times out otherwise is logged and the read goes on, on the private stream (step 3),
    bounded by its probe (`DeviceReader.wait_ready`)."""
    if not STOP.ran:
        MARK.wait_done(ready_timeout_s)  # refuse before aborting anything
    report = STOP.run(abort_timeout_s, MARK.binding)
    MARK.wait_done(ready_timeout_s)  # the update's own kernels: finite once nothing hangs
    if not report.ok and MARK.module is not None and one_work_queue():
        raise FallbackUnsafe(
            f"{report.describe()}; with CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares one "
            "hardware queue and a read could wait behind the hung kernel for good: not saving "
            "on this rank (the controller saves from another holder, or fails the save)")
    return FaultRead(GATHERED.done_at(step), report)


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
            binding = self._mark.binding
            if binding.kind == "none":  # armed by hand with a module (tests, tools)
                binding = DeviceBinding("cuda", self._mark.index)
            self._stream = private_stream(self._module, binding)
        return self._stream

    def wait_ready(self, gather: Optional[GatherMark] = None) -> None:
        """Order the private stream after the mark's event, after waiting (bounded) for it,
        and after `gather`'s event too (the live params are read: GATHERED said done)."""
        self._mark.wait_done(self._timeout_s)
        if self._mark.event is not None and self._mark.step is not None:
            self.stream().wait_event(self._mark.event)
        if gather is not None and gather.event is not None:
            self.stream().wait_event(gather.event)
        self._passes("reach the state to read", config.FALLBACK_PROBE_S)

    def _passes(self, what: str, timeout_s: float) -> None:
        """Record an event on the private stream and poll it (bounded): DeviceNotReady when the
        stream cannot get past what is queued ahead of it, such as a kernel hung at the head of
        the one hardware queue when the abort failed (D5). Polling, never a blocking wait."""
        probe = self._module.Event()
        probe.record(self.stream())
        _poll(probe, timeout_s, lambda: (
            f"the private read stream of {self._mark.binding.describe()} did not {what} "
            f"within {timeout_s:g} s: something queued ahead of it on the device hangs (an "
            "abort that failed); not reading"))

    @contextlib.contextmanager
    def reading(self, gather: Optional[GatherMark] = None) -> Iterator[Any]:
        """Make the private stream current for this thread, after the mark's event (and
        `gather`'s)."""
        self.wait_ready(gather)
        stream = self.stream()
        with self._module.stream(stream):
            try:
                yield stream
            finally:  # every copy issued inside is complete on leaving (bounded)
                self._passes("finish its copies", self._timeout_s)

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


def reading(live_params: bool = False) -> contextlib.AbstractContextManager:
    """The context a checkpoint write runs in: a private, ordered stream on a device; nothing
    (a null context) on a rank without one. `live_params`: the write reads the model's live
    params, so the stream also waits for the param all-gather's event. One reader (and
    stream) per handler thread."""
    if MARK.module is None:
        return contextlib.nullcontext()
    reader = getattr(_READERS, "reader", None)
    if reader is None or reader._mark is not MARK or reader._module is not MARK.module:
        reader = _READERS.reader = DeviceReader(MARK)
    return reader.reading(GATHERED if live_params else None)
