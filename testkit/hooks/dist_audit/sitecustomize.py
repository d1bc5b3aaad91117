"""Test-only audit of every torch.distributed call a real Megatron worker makes (no tree edits).

Put this folder first on PYTHONPATH and set ``TTP_DIST_AUDIT_DIR``: every process appends one
JSON line per call to ``<dir>/rank-<rank>-<pid>.jsonl``: the operation, the group (``default``,
or the ranks and the ``backend`` argument it was created with), the devices and bytes of the
tensors handed over, the thread, and the phase the call happened in:

* ``train``: inside ``megatron.training.train_step`` (reduce, update, param gather, barrier);
* ``load``: inside ``mindio_ttp.megatron_ttp.load.load_checkpoint``;
* ``state_dict``: inside ``ReplicatedOptimizer.state_dict`` (a ``state_dict`` marker line is
  written for every call, so a test can tell "called, no collective" from "never called");
* ``fault-save``: inside the dying-checkpoint save handler (the TTP processor's thread);
* ``other``: anything else (start-up, Megatron's periodic save, logging).

The fault-time exchange builds ``torch.distributed.ProcessGroupGloo`` objects directly; they are
wrapped so their calls are recorded as ``pg.<op>`` with group ``fault-gloo``. The fault
injector of ``../fault_hook`` still works: this file runs it after installing the audit.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path

from testkit.import_hooks import after_import, run_hook_file

_HERE = Path(__file__).resolve().parent
_local = threading.local()
_lock = threading.Lock()
_state: dict = {"file": None, "groups": {}}

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
               "all_gather", "all_gather_into_tensor", "_all_gather_base", "broadcast",
               "barrier", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
               "send", "recv", "batch_isend_irecv", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list")
# isend/irecv stay unwrapped: P2POp accepts only torch's own functions (batch_isend_irecv is
# recorded with the tensors of its P2POps)


def phase() -> str:
    return getattr(_local, "phase", "other")


@functools.cache
def _torch():
    import torch

    return torch


def _tensors(obj, out):
    torch = _torch()
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, torch.distributed.P2POp):
        out.append(obj.tensor)
    return out


def _group_name(group) -> object:
    if group is None:
        return "default"
    info = _state["groups"].get(id(group))
    return info if info is not None else f"unregistered {type(group).__name__}"


def _write(record: dict) -> None:
    torch = _torch()
    with _lock:
        if _state["file"] is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
            path = Path(os.environ["TTP_DIST_AUDIT_DIR"]) / f"rank-{rank}-{os.getpid()}.jsonl"
            _state["file"] = open(path, "a", buffering=1)
        record.update(phase=phase(), thread=threading.current_thread().name,
                      megatron_device=_state.get("device", "unknown (no model seen yet)"))
        _state["file"].write(json.dumps(record) + "\n")


def _wrap_collective(name, real):
    def audited(*args, **kwargs):
        tensors = _tensors(list(args) + list(kwargs.values()), [])
        group = kwargs.get("group")
        if group is None and name == "batch_isend_irecv" and args and args[0]:
            group = args[0][0].group
        if group is None:
            group = next((a for a in args if isinstance(a, _torch().distributed.ProcessGroup)),
                         None)
        dist = _torch().distributed
        size = dist.get_world_size(group) if dist.is_initialized() else 0
        _write({"op": name, "group": _group_name(group), "group_size": size,
                "devices": sorted({str(t.device) for t in tensors}),
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "tensor_bytes": [t.numel() * t.element_size() for t in tensors][:64],
                "p2p": [getattr(getattr(o, "op", None), "__name__", "?") for o in
                        (args[0] if name == "batch_isend_irecv" and args else [])][:64]})
        return real(*args, **kwargs)

    return audited


def _wrap_new_group(real):
    def new_group(*args, **kwargs):
        group = real(*args, **kwargs)
        ranks = kwargs.get("ranks", args[0] if args else None)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        info = {"ranks": list(ranks) if ranks is not None else None,
                "backend": None if backend is None else str(backend)}
        _state["groups"][id(group)] = info
        _write({"op": "new_group", "group": info, "devices": [], "bytes": 0})
        return group

    return new_group


class _AuditedGloo:
    """A ProcessGroupGloo built by the fault-time exchange, its calls recorded."""

    def __init__(self, real_cls, *args, **kwargs):
        self._pg = real_cls(*args, **kwargs)

    def _record(self, op, tensors):
        found = _tensors(tensors, [])
        _write({"op": f"pg.{op}", "group": "fault-gloo",
                "devices": sorted({str(t.device) for t in found}),
                "bytes": sum(t.numel() * t.element_size() for t in found)})

    def allreduce(self, tensors, *args, **kwargs):
        self._record("allreduce", tensors)
        return self._pg.allreduce(tensors, *args, **kwargs)

    def allgather(self, outputs, inputs, *args, **kwargs):
        self._record("allgather", [outputs, inputs])
        return self._pg.allgather(outputs, inputs, *args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._pg, name)
        if callable(attr):
            def recorded(*args, **kwargs):
                self._record(name, list(args))
                return attr(*args, **kwargs)

            return recorded
        return attr


def _note_device(model) -> None:
    """The device Megatron runs on: where its model lives (the adaptor's answer to
    torch.cuda.current_device() is scoped to Megatron's modules, not this one)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for param in chunk.parameters():
            _state["device"] = str(param.device)
            return


def _in_phase(name, fn, model_arg=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if model_arg is not None and len(args) > model_arg:
            _note_device(args[model_arg])
        previous = phase()
        _local.phase = name
        try:
            return fn(*args, **kwargs)
        finally:
            _local.phase = previous

    return wrapper


def _install_dist() -> None:
    dist = _torch().distributed
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _wrap_collective(name, getattr(dist, name)))
    dist.new_group = _wrap_new_group(dist.new_group)
    real_gloo = dist.ProcessGroupGloo
    dist.ProcessGroupGloo = functools.partial(_AuditedGloo, real_gloo)


def _install_phases(training) -> None:
    from mindio_ttp.megatron_ttp import load, save
    from mindio_ttp.megatron_ttp.replicated_optimizer import ReplicatedOptimizer

    training.train_step = _in_phase("train", training.train_step, model_arg=2)
    load.load_checkpoint = _in_phase("load", load.load_checkpoint, model_arg=0)
    save.ttp_save_checkpoint = _in_phase("fault-save", save.ttp_save_checkpoint)
    real_state_dict = ReplicatedOptimizer.state_dict

    def state_dict(self):
        _write({"op": "state_dict", "group": None, "devices": [], "bytes": 0})
        return real_state_dict(self)

    ReplicatedOptimizer.state_dict = _in_phase("state_dict", state_dict)


def _install() -> None:
    if not os.environ.get("TTP_DIST_AUDIT_DIR"):
        return
    _install_dist()
    # before the fault hook's finder, which it asks first: the phase wraps train_step outermost
    after_import("megatron.training", _install_phases)


run_hook_file(str(_HERE.parent / "fault_hook" / "sitecustomize.py"))
_install()
