"""The one place that asks the installed torch and numpy what they can do.

Every drift fix in :mod:`mindio_ttp.compat` is applied only where the answer here says it is
needed, and each answer is a feature check (does the attribute exist, what default does the
signature carry), never a version comparison: an NGC or Ascend build reports versions such as
``1.14.0a0+410ce96`` or ``2.1.0.post3`` whose number says little about which APIs it has.
:func:`torch_version` is there for reports only.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

#: numpy aliases Megatron-LM 285068c uses (``data/indexed_dataset.py:98,271``), removed in
#: numpy 1.24, and what each stood for.
NUMPY_ALIASES: Dict[str, type] = {"float": float, "int": int, "bool": bool, "object": object,
                                  "str": str, "long": int}


def torch_version() -> Tuple[int, int]:
    """(major, minor) of the installed torch, for reports (``1.14.0a0+410ce96`` -> (1, 14))."""
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def lacks_torch_six() -> bool:
    """``torch._six`` was removed in torch 2.0; ``optimizer/clip_grads.py:6`` imports it."""
    try:
        return importlib.util.find_spec("torch._six") is None
    except (ImportError, ValueError):
        return True


def lacks_typed_storage_untyped() -> bool:
    """``TypedStorage._untyped()`` (``optimizer/distrib_optimizer.py:391``) existed only in the
    torch 1.13/1.14 nightlies NGC shipped: the 1.13.1 release and every 2.x call it
    ``untyped()``."""
    return not hasattr(torch.storage.TypedStorage, "_untyped")


def load_defaults_to_weights_only() -> bool:
    """Whether ``torch.load`` without ``weights_only`` refuses pickled objects (torch >= 2.6),
    as in every Megatron checkpoint (its ``args`` is an ``argparse.Namespace``)."""
    try:
        param = inspect.signature(torch.load).parameters.get("weights_only")
    except (TypeError, ValueError):
        return False
    if param is None or param.default is False:
        return False
    if param.default is True:
        return True
    decide: Callable[..., bool] = getattr(torch.serialization, "_default_to_weights_only", None)
    return bool(decide(None)) if decide is not None else False


def missing_numpy_aliases() -> List[str]:
    """The :data:`NUMPY_ALIASES` this numpy no longer has."""
    return [name for name in NUMPY_ALIASES if name not in np.__dict__]


def adam_has_decoupled_weight_decay() -> bool:
    """``torch.optim.Adam(decoupled_weight_decay=...)``: the CPU adaptor's FusedAdam builds
    apex's AdamW mode on it where it exists."""
    try:
        return "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters
    except (TypeError, ValueError):
        return False


# -- what the collective stack can do after a fault (faulttime/abort.py, recovery's gate) ---------
# Each answer below is read from the object that will be called (a backend, torch_npu's modules),
# never from a version number: torch's NCCL binding renamed its abort three times, and NGC and
# Ascend builds carry version strings that say little about which of the names they have.

#: ProcessGroupNCCL's abort, in the order tried: ``abort`` (bound from the 2.5 era, PR #132291),
#: ``_shutdown`` (2.2-2.4, PR #111392 replaced ``_abort`` with it), ``_abort`` (2.1, PR #96017).
NCCL_ABORTS = ("abort", "_shutdown", "_abort")
#: ProcessGroupHCCL's abort (torch_npu ``csrc/distributed/Init.cpp``). Never ``abort``: from
#: torch 2.7 ``Backend.abort`` exists and is a no-op that ProcessGroupHCCL does not override.
HCCL_ABORTS = ("abort_hccl_comm",)
ABORTS = {"nccl": NCCL_ABORTS, "hccl": HCCL_ABORTS}
#: NCCL version from which aborting several hung communicators together (inside one
#: ncclGroupStart/End) is NCCL's supported remedy (pytorch #119797, PR #132291).
NCCL_GROUP_ABORT = (2, 22, 0)


def abort_method(backend_name: str, backend: object) -> Optional[Callable[[], object]]:
    """The call that aborts `backend`'s communicators now, or None when it has none of the
    names its kind is known by (ABORTS). HCCL's takes a reason."""
    for name in ABORTS.get(backend_name, ()):
        method = getattr(backend, name, None)
        if callable(method):
            if backend_name == "hccl":
                return functools.partial(method, "ttp: fault")
            return method
    return None


def nccl_group_calls(backend: object) -> Optional[Tuple[Callable[[], object],
                                                        Callable[[], object]]]:
    """``(_group_start, _group_end)`` of a ProcessGroupNCCL that has them (the 2.5 era on),
    which torch's own ``_abort_process_group`` wraps around every group's abort: the aborts of
    several hung communicators then complete together instead of one blocking on another's
    kernel (pytorch #119797)."""
    start, end = getattr(backend, "_group_start", None), getattr(backend, "_group_end", None)
    return (start, end) if callable(start) and callable(end) else None


def nccl_version() -> Optional[Tuple[int, int, int]]:
    """The NCCL this torch loads (``torch.cuda.nccl.version()``), or None without one."""
    try:
        found = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build, or no NCCL library
        return None
    if isinstance(found, int):  # older torch: one integer, 2.18.3 -> 21803 (or 2183)
        major, rest = divmod(found, 10000) if found >= 10000 else divmod(found, 1000)
        return int(major), int(rest // 100), int(rest % 100)
    try:
        return tuple(int(p) for p in found)[:3]  # type: ignore[return-value]
    except (TypeError, ValueError):
        return None


def npu_device_stop() -> bool:
    """torch_npu's ``npu.stop_device`` and ``npu.restart_device`` (v6.0.rc3 on): the device's
    every task, HCCL's included, is dropped, from any thread."""
    npu = getattr(sys.modules.get("torch_npu"), "npu", None)
    return callable(getattr(npu, "stop_device", None)) and \
        callable(getattr(npu, "restart_device", None))


def npu_reinit_process_group() -> Optional[Callable[..., object]]:
    """torch_npu's ``reinit_process_group(group, rebuild_link)``, where this build has it."""
    torch_npu = sys.modules.get("torch_npu")
    dist = getattr(torch_npu, "distributed", None)
    found = getattr(dist, "reinit_process_group", None) or \
        getattr(torch.distributed, "reinit_process_group", None)
    return found if callable(found) else None


def recovery_support(backend_name: str, backend: object = None) -> Tuple[bool, str]:
    """Whether this stack can recover in memory after a fault, and why (or why not), in words
    a user can act on. The two properties it needs, each read from the stack's features:

    * **abort a collective another thread waits in** (the survivors' main threads spin in one:
      release.py): NCCL needs an abort on the backend (`NCCL_ABORTS`), and, because a rank
      holds several hung communicators, torch's group abort (``_abort_process_group``, whose
      ``_group_start``/``_group_end`` make NCCL abort them together: pytorch #119797, the 2.5
      era on) with an NCCL that supports it (`NCCL_GROUP_ABORT`); HCCL needs torch_npu's
      device stop (v6.0.rc3 on), which drops every task of the device from any thread;
    * **build new groups after the abort**: torch's group abort is also its own
      abort-then-re-initialise path (it forgets the aborted world); torch_npu rebuilds an
      aborted HCCL communicator after ``abort_hccl_comm`` (its ``reinit_process_group``).

    gloo needs neither: a dead peer's collective raises by itself. Where the stack lacks one,
    the job uses the dying checkpoint (docs/stack.md has the table per torch release)."""
    if backend_name == "gloo":
        return True, "gloo: a dead peer's collective raises by itself, nothing to abort"
    if backend_name == "nccl":
        if backend is None:
            backend = getattr(torch.distributed, "ProcessGroupNCCL", None)
        if abort_method("nccl", backend) is None:
            return False, (f"ProcessGroupNCCL has none of {', '.join(NCCL_ABORTS)}: nothing "
                           "can end a collective that spins on a dead peer")
        group_abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
        if group_abort is None:
            return False, ("this torch has no group abort (torch.distributed's "
                           "_abort_process_group, the 2.5 era on): aborting a rank's hung "
                           "communicators one by one can deadlock (pytorch #119797)")
        found = nccl_version()
        if found is None or found < NCCL_GROUP_ABORT:
            said = "unknown" if found is None else ".".join(map(str, found))
            return False, (f"NCCL {said} is older than "
                           f"{'.'.join(map(str, NCCL_GROUP_ABORT))}, the first to abort several "
                           "hung communicators together (an NGC container's newer NCCL has it)")
        return True, (f"NCCL {'.'.join(map(str, found))} with torch's group abort: hung "
                      "communicators are aborted together, then the world is re-initialised")
    if backend_name == "hccl":
        if not npu_device_stop():
            return False, ("this torch_npu has no npu.stop_device/restart_device (v6.0.rc3 on): "
                           "nothing can end an HCCL task that waits on a dead peer")
        if backend is not None and abort_method("hccl", backend) is None:
            return False, ("ProcessGroupHCCL has no abort_hccl_comm: its communicator cannot be "
                           "released for a new one")
        return True, ("torch_npu's device stop ends every task, abort_hccl_comm releases the "
                      "communicators, then the world is re-initialised")
    return False, (f"backend {backend_name!r}: in-memory recovery knows how to stop nccl, hccl "
                   "and gloo only")


def empty_cache_releases_gil(seconds: float = 0.2,
                             empty_cache: Optional[Callable[[], object]] = None,
                             pend: Optional[Callable[[float], None]] = None) -> Optional[bool]:
    """Whether ``torch.cuda.empty_cache()`` lets other Python threads run while it waits for
    the device, measured (None without CUDA): older torch calls the allocator's emptyCache
    holding the GIL, and emptyCache waits for the events of freed blocks a stream recorded,
    ProcessGroupNCCL's among them: behind a hung collective, the processor's heartbeat
    thread would stop and the rank would look dead (D10). `pend(seconds)` frees a block whose
    event completes `seconds` later (by default a CUDA block recorded on a side stream behind a
    ``torch.cuda._sleep``); a ticker thread counts while `empty_cache` waits."""
    if empty_cache is None or pend is None:
        if not torch.cuda.is_available():
            return None
        empty_cache, pend = torch.cuda.empty_cache, _pend_cuda_block
    import threading
    import time

    pend(seconds)
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, name="ttp-gil-probe", daemon=True)
    ticker.start()
    time.sleep(0.01)
    before = ticks[0]
    started = time.monotonic()
    empty_cache()
    waited = time.monotonic() - started
    during = ticks[0] - before
    stop.set()
    ticker.join(1.0)
    if waited < seconds / 2:
        return True  # it did not wait: nothing to hold (treated as releasing)
    return during >= max(2, int(waited * 1000) // 10)  # at least a tenth of the ticks


def _pend_cuda_block(seconds: float) -> None:
    side = torch.cuda.Stream()
    rate_khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                       "clock_rate", 0) or 1_500_000
    block = torch.empty(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(seconds * rate_khz * 1000))
    block.record_stream(side)
    del block  # freed now; reusable (and releasable) only once `side` passes the sleep
