"""Stop this process's device work after a fault: abort every communicator of every group.

Why. A survivor's device queue usually holds a collective that waits for the dead peer and
never finishes, and work queued behind it (a training kernel, the param copies after an
all-gather). Reading device memory then depends on how the device schedules around that
kernel, which CUDA and CANN do not promise for our case (``CUDA_DEVICE_MAX_CONNECTIONS=1``
folds every stream onto one hardware queue; torch_npu drains one task queue per device before
a blocking copy). Both anchors stop the device's work first: NVRx's in-process restart aborts
every communicator (``inprocess/abort.py``: one thread per group), MindSpeed's TFT calls
``torch_npu.npu.stop_device``. So does this module, once, before the dying checkpoint reads.

What, per backend (the one table: `_plan`; which method a backend has is asked of the backend
itself, in the aborting thread, by `mindio_ttp.compat.features`, never read from a version):

* **NCCL**: the first of ``abort`` (torch's 2.5 era on), ``_shutdown`` (2.2-2.4), ``_abort``
  (2.1) the backend has. Where ProcessGroupNCCL has ``_group_start``/``_group_end`` (the 2.5
  era on) every NCCL backend is aborted inside one group call, in one thread, as torch's own
  ``_abort_process_group`` does: NCCL then aborts the hung communicators together. Elsewhere
  each group is aborted in a thread of its own, all at once, as NVRx does: aborted one after
  the other, one communicator's abort can block on another's hung kernel (pytorch #119797).
* **HCCL** (torch_npu): the device is stopped once, ``torch_npu.npu.stop_device(i)``, which
  ends every task queued on it, HCCL's included, then ``restart_device(i)`` in its default mode
  (tensors stay valid), because torch_npu refuses device work on a stopped device and the save
  must read. Without those calls (torch_npu before v6.0.rc3, which this project does not
  support: it has no ``SyncLaunchStream`` either), each HCCL backend's ``abort_hccl_comm``;
  never ``abort``, which from torch 2.7 is the base class's no-op.
* **gloo** and anything else: nothing. A dead peer's TCP reset fails a gloo collective, a hung
  peer is killed by its launcher, and host memory has no device queue to wait behind. (torch's
  ``ProcessGroupGloo.abort`` exists but would fail the survivors' own pending collectives for
  nothing.)

Every aborting thread binds the device first (`DeviceBinding.bind`): a new thread's current
CUDA device is 0, and an abort there could make a context on another rank's GPU.

Bounded: every call runs in a daemon thread and the whole abort waits at most ``timeout_s``
(``config.ABORT_TIMEOUT_S``); a call that hangs (``ncclCommAbort`` can, in NCCL's proxy thread:
nccl #1013, #1777, pytorch #119215) is reported as timed out and left behind, and the caller
goes on to its fallback (the dying checkpoint reads on a private stream from outside torch's
pool, `device_copy`). `abort_all` never raises for a backend: it returns an `AbortReport`.

Afterwards the process can build new groups: with ``destroy=True`` the groups are also
destroyed (``torch.distributed.destroy_process_group``), after which ``init_process_group`` on
a fresh store works again (tests/writer/test_abort.py does exactly that on gloo). The watchdog
of an aborted NCCL group stops by itself; nothing here touches the default stream.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from mindio_ttp import config
from mindio_ttp.faulttime.device import NO_DEVICE, DeviceBinding

log = logging.getLogger("mindio_ttp.processor")

ABORTED, SKIPPED, FAILED, TIMED_OUT = "aborted", "skipped", "failed", "timed out"
DEVICE_BACKENDS = ("nccl", "hccl")


@dataclass(frozen=True)
class GroupAbort:
    """What happened to one backend of one process group."""

    group: str
    backend: str
    outcome: str  # ABORTED, SKIPPED, FAILED or TIMED_OUT
    detail: str = ""


@dataclass(frozen=True)
class AbortReport:
    groups: Tuple[GroupAbort, ...]
    device: str  # what was done to the device itself ("" when nothing)
    destroyed: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """Every device communicator is gone (skipped ones never held device work)."""
        return all(g.outcome in (ABORTED, SKIPPED) for g in self.groups) and \
            not self.device.startswith((FAILED, TIMED_OUT))

    @property
    def aborted(self) -> List[str]:
        return [g.group for g in self.groups if g.outcome == ABORTED]

    def describe(self) -> str:
        counts: dict = {}
        for g in self.groups:
            counts[g.outcome] = counts.get(g.outcome, 0) + 1
        parts = [f"{n} {what}" for what, n in sorted(counts.items())] or ["no process group"]
        bad = [f"{g.group} ({g.backend}): {g.outcome} {g.detail}".strip()
               for g in self.groups if g.outcome in (FAILED, TIMED_OUT)]
        text = f"abort in {self.seconds:.3f} s: " + ", ".join(parts)
        if self.device:
            text += f"; device: {self.device}"
        if self.destroyed:
            text += "; process groups destroyed"
        return text + (f"; {'; '.join(bad[:4])}" if bad else "")


def _name(obj: Any) -> str:
    try:
        return str(obj.name()).lower()
    except Exception:  # noqa: BLE001 - a backend without name(): its class says enough
        return type(obj).__name__.lower()


def _backends(pg: Any) -> List[Tuple[str, Any]]:
    """(backend name, backend) of every device type the group serves, each backend once; a
    group that exposes no backends (older torch, test doubles) is its own backend."""
    found: List[Tuple[str, Any]] = []
    for dev in getattr(pg, "_device_types", None) or []:
        try:
            backend = pg._get_backend(dev)
        except (RuntimeError, ValueError):
            continue
        if all(backend is not b for _, b in found):
            found.append((_name(backend), backend))
    return found or [(_name(pg), pg)]


def _dist() -> Any:
    """torch.distributed where this process imported it, else None: a process that never
    imported torch has no process group, and importing torch here (seconds) would delay the
    abort of a process that does."""
    return sys.modules.get("torch.distributed")


def _group_name(pg: Any) -> str:
    try:
        name = _dist().distributed_c10d._world.pg_names.get(pg)
        if name is not None:
            return str(name)
    except Exception:  # noqa: BLE001 - not initialised, or a test double
        pass
    return str(getattr(pg, "group_name", None) or f"group@{id(pg):x}")


def _all_groups() -> List[Any]:
    dist = _dist()
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_names)


def _features() -> Any:
    from mindio_ttp.compat import features  # torch is imported wherever groups exist

    return features


def _abort_one(backend_name: str, backend: Any, binding: DeviceBinding) -> Callable[[], None]:
    """The body of one aborting thread: bind, find the backend's abort, call it (module doc)."""

    def run() -> None:
        binding.bind()
        features = _features()
        call = features.abort_method(backend_name, backend)
        if call is None:
            raise RuntimeError(f"this {backend_name} backend ({type(backend).__name__}) has "
                               f"none of {', '.join(features.ABORTS[backend_name])}")
        call()

    return run


def _abort_together(backends: Sequence[Any], binding: DeviceBinding,
                    errors: List[str]) -> Callable[[], None]:
    """The body of the one thread that aborts every NCCL backend inside one NCCL group call
    (module doc); an abort that raises is noted in `errors` (by index) and the rest go on."""

    def run() -> None:
        binding.bind()
        features = _features()
        start, end = features.nccl_group_calls(backends[0])
        start()
        try:
            for i, backend in enumerate(backends):
                call = features.abort_method("nccl", backend)
                try:
                    if call is None:
                        raise RuntimeError(f"{type(backend).__name__} has none of "
                                           f"{', '.join(features.NCCL_ABORTS)}")
                    call()
                except Exception as exc:  # noqa: BLE001 - reported per group
                    errors[i] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            end()

    return run


def _groups_together(nccl: Sequence[Tuple[str, Any]]) -> bool:
    """Whether the NCCL backends can be aborted inside one group call (module doc)."""
    if len(nccl) < 2:
        return False
    try:
        return _features().nccl_group_calls(nccl[0][1]) is not None
    except Exception:  # noqa: BLE001 - cannot even ask: one thread per group, as before
        return False


def _npu_stop_restart(binding: DeviceBinding) -> Optional[Callable[[], None]]:
    """torch_npu's device stop then restart for the bound NPU, or None (no torch_npu, or an
    older one without them: the HCCL backends are aborted one by one instead)."""
    if binding.kind != "npu":
        return None
    torch_npu = sys.modules.get("torch_npu")
    npu = getattr(torch_npu, "npu", None)
    stop, restart = getattr(npu, "stop_device", None), getattr(npu, "restart_device", None)
    if stop is None or restart is None:
        return None

    def run() -> None:
        binding.bind()  # torch_npu needs set_device in every thread before device work
        result = stop(binding.index)
        if result not in (None, 0):
            raise RuntimeError(f"torch_npu.npu.stop_device({binding.index}) returned {result}")
        restart(binding.index)  # default mode: no stream rebuild, tensors stay valid

    return run


class _Call(threading.Thread):
    def __init__(self, fn: Callable[[], None], name: str) -> None:
        super().__init__(target=self._run, name=name, daemon=True)
        self.fn, self.error = fn, ""

    def _run(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - reported, never raised
            self.error = f"{type(exc).__name__}: {exc}"[:300]


def _join_all(calls: Sequence[_Call], deadline: float) -> None:
    for call in calls:
        call.join(max(0.0, deadline - time.monotonic()))


def abort_all(timeout_s: float = config.ABORT_TIMEOUT_S, *,
              binding: DeviceBinding = NO_DEVICE, groups: Optional[Iterable[Any]] = None,
              destroy: bool = False) -> AbortReport:
    """Abort every device communicator of every process group (`groups`: default, all of
    torch's), in parallel, waiting at most `timeout_s`; with `destroy`, then destroy torch's
    process groups so that new ones can be made. Never raises for a backend (module doc)."""
    started = time.monotonic()
    deadline = started + timeout_s
    results: List[GroupAbort] = []
    with_device: List[str] = []  # HCCL groups that the device stop ends
    to_abort: List[Tuple[str, str, Any]] = []  # (group, backend name, backend)
    device_call = _npu_stop_restart(binding)
    for pg in list(_all_groups() if groups is None else groups):
        gname = _group_name(pg)
        for bname, backend in _backends(pg):
            if bname == "hccl" and device_call is not None:
                with_device.append(gname)
            elif bname in DEVICE_BACKENDS:
                to_abort.append((gname, bname, backend))
            else:
                why = ("no device work (a dead peer's connection reset fails its collectives)"
                       if bname == "gloo" else "not a device communicator")
                results.append(GroupAbort(gname, bname, SKIPPED, why))
    nccl = [(g, b) for g, n, b in to_abort if n == "nccl"]
    together = _groups_together(nccl)
    errors: List[str] = [""] * len(nccl)
    # (groups, backend name, thread, errors by group or None)
    pending: List[Tuple[List[str], str, _Call, Optional[List[str]]]] = []
    if together:
        pending.append(([g for g, _ in nccl], "nccl", _Call(
            _abort_together([b for _, b in nccl], binding, errors), "ttp-abort-nccl"), errors))
    for gname, bname, backend in to_abort:
        if bname == "nccl" and together:
            continue
        pending.append(([gname], bname,
                        _Call(_abort_one(bname, backend, binding), f"ttp-abort-{gname}"), None))
    device_thread = _Call(device_call, "ttp-abort-device") if device_call else None
    threads = [t for _, _, t, _ in pending] + ([device_thread] if device_thread else [])
    for thread in threads:
        thread.start()
    _join_all(threads, deadline)
    for gnames, bname, thread, each in pending:
        for i, gname in enumerate(gnames):
            if thread.is_alive():
                results.append(GroupAbort(gname, bname, TIMED_OUT, f"after {timeout_s:g} s"))
            elif thread.error or (each and each[i]):
                results.append(GroupAbort(gname, bname, FAILED, thread.error or each[i]))
            else:
                results.append(GroupAbort(gname, bname, ABORTED))
    device = ""
    if device_thread is not None:
        outcome = (TIMED_OUT if device_thread.is_alive()
                   else FAILED if device_thread.error else ABORTED)
        device = {TIMED_OUT: f"{TIMED_OUT}: stop/restart of {binding.describe()}",
                  FAILED: f"{FAILED}: {device_thread.error}",
                  ABORTED: f"{binding.describe()} stopped and restarted"}[outcome]
        results += [GroupAbort(g, "hccl", outcome, f"by the stop of {binding.describe()}")
                    for g in with_device]
    destroyed = destroy and _destroy(deadline)
    report = AbortReport(tuple(results), device, destroyed, time.monotonic() - started)
    (log.info if report.ok else log.warning)("%s", report.describe())
    return report


def _destroy(deadline: float) -> bool:
    return destroy_groups(max(1.0, deadline - time.monotonic()))


def destroy_groups(timeout_s: float, late: Callable[[], None] = lambda: None) -> bool:
    """Destroy every process group, in the calling thread, watched: when it has not returned
    within `timeout_s`, a watchdog thread calls `late()` (the recovery fails itself then, so the
    controller goes on to the dying checkpoint while this thread waits) and this returns False
    if it ever returns. torch 2.6's graceful shutdown waits for every unfinished kernel of a
    group that was not aborted, so a group whose abort failed could hold it for good. In the
    calling thread, not another: torch's destroy run elsewhere left a process that crashed at
    exit (std::terminate, on the NCCL-like test backend after a stopped peer), and the thread
    that waits would be stuck either way. HCCL backends first release their communicator with
    ``abort_hccl_comm``, as torch_npu's own ``reinit_process_group`` does before a new one is
    built (docs/stack.md says why the recovery follows that part of it and not the rest).
    False also when the destroy raised (logged)."""
    dist = _dist()
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    returned = threading.Event()
    overdue: List[bool] = []

    def watch() -> None:
        if not returned.wait(timeout_s):
            overdue.append(True)
            log.warning("destroy_process_group did not return within %g s", timeout_s)
            late()

    threading.Thread(target=watch, name="ttp-destroy-watch", daemon=True).start()
    try:
        for pg in _all_groups():
            for name, backend in _backends(pg):
                call = _features().abort_method(name, backend) if name == "hccl" else None
                if call is not None:
                    call()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        log.warning("destroy_process_group failed: %s: %s", type(exc).__name__, exc)
        return False
    finally:
        returned.set()
    return not overdue
