"""Test-only: how many bytes a real Megatron worker's optimizer holds, measured from outside.

Put this folder first on PYTHONPATH and set ``TTP_OPTIM_MEMORY_DIR``: once the first
``megatron.training.train_step`` has returned (Adam allocates its state at the first step),
each rank writes ``<dir>/rank-<rank>.json`` with the model's parameter count on that rank and
the bytes of every tensor storage reachable from the optimizer object that is not the model's
own (its parameters, buffers and gradient buffers, and views of them). The same code measures
Megatron's stock DistributedOptimizer and ReplicatedOptimizer, so the comparison rests on what
each one allocated, not on either one's own accounting. The fault hook still works: this file
runs it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from testkit.import_hooks import after_import, run_hook_file

_HERE = Path(__file__).resolve().parent
ROOTS = ("megatron", "mindio_ttp", "torch", "apex")  # whose objects are walked into


def held_bytes(optimizer, model_chunks) -> int:
    """Bytes of the distinct storages reachable from `optimizer` that the model does not own."""
    import torch

    def key(t) -> int:
        return t.untyped_storage().data_ptr()

    own = set()
    for chunk in model_chunks:
        for t in [*chunk.parameters(), *chunk.buffers()]:
            own.add(key(t))
        for buf in getattr(chunk, "_grad_buffers", {}).values():
            own.add(key(buf.data))
    storages = {}
    seen = set()
    stack = [optimizer]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            if key(obj) not in own and obj.untyped_storage().nbytes():
                storages[key(obj)] = obj.untyped_storage().nbytes()
        elif isinstance(obj, torch.nn.Module):
            continue  # the model chunks: not the optimizer's
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.split(".")[0] in ROOTS:
            try:
                stack.extend(vars(obj).values())
            except TypeError:  # no __dict__ (C++ objects: process groups, ...)
                pass
    return sum(storages.values())


def _wrap(training, out: Path) -> None:
    real = training.train_step
    done = []

    def measured_train_step(forward_step_func, data_iterator, model, optimizer,
                            opt_param_scheduler, *rest, **kwargs):
        result = real(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                      *rest, **kwargs)
        if not done:
            done.append(True)
            import torch

            chunks = model if isinstance(model, (list, tuple)) else [model]
            record = {"rank": torch.distributed.get_rank(),
                      "optimizer": type(optimizer).__name__,
                      "params": sum(p.numel() for c in chunks for p in c.parameters()),
                      "bytes": held_bytes(optimizer, chunks)}
            tmp = out / f".rank-{record['rank']}.tmp"
            tmp.write_text(json.dumps(record))
            os.replace(tmp, out / f"rank-{record['rank']}.json")
        return result

    training.train_step = measured_train_step


def _install() -> None:
    target = os.environ.get("TTP_OPTIM_MEMORY_DIR")
    if target:
        after_import("megatron.training", lambda module: _wrap(module, Path(target)))


run_hook_file(str(_HERE.parent / "fault_hook" / "sitecustomize.py"))
_install()
