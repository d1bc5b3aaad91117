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
