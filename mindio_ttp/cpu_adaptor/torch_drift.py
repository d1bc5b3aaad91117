"""torch 2.x / numpy 2.x API drift that Megatron-LM 285068c (January 2023) trips over.

Patches (Megatron file:line they serve); "scoped" ones only change Megatron's calls
(:mod:`.scope`):

* ``torch._six`` (removed in torch 2.0): ``optimizer/clip_grads.py:6`` imports ``inf`` from it.
  A small module is registered in ``sys.modules``.
* numpy aliases ``np.float/int/bool/object/str/long`` (removed in numpy 1.24):
  ``data/indexed_dataset.py:98,271``; restored only where missing.
* ``torch.load`` (scoped): since torch 2.6 ``weights_only`` defaults to True and refuses the
  pickled ``argparse.Namespace`` in every checkpoint: ``checkpointing.py:399,401,413,414,650``.
  Megatron calls get ``weights_only=False`` unless they pass it. Worth knowing: the failure is
  caught at ``checkpointing.py:417-420`` and becomes ``sys.exit()`` with exit code 0.
* ``DistributedDataParallel`` (scoped): ``training.py:288-290`` (``--DDP-impl torch``) passes
  ``device_ids=[current_device()]``, which torch rejects for CPU modules; dropped.
* ``TypedStorage._untyped`` -> alias of ``untyped`` (renamed in torch 2.0):
  ``optimizer/distrib_optimizer.py:391`` builds the param buffer as a view of the grad buffer.
* ``DataLoader`` (scoped): building an iterator draws a seed from the default CPU generator,
  which on CPU is also the "CUDA" generator dropout uses; Megatron builds its iterators
  (``training.py:134``) after ``load_checkpoint`` restored the RNG (``training.py:377``), so a
  resumed run would drift. Megatron's loaders (``data/data_samplers.py:43``) get a private
  generator.
* exit (process-wide, only when a default process group is still alive at exit): Megatron
  never calls ``destroy_process_group`` (``training.py:729,750,759`` end the run with
  ``sys.exit()``, ``pretrain_gpt.py`` just returns). With torch 2.x gloo, worker threads may
  then still hold work objects with Python references while the interpreter is torn down, and
  a rank dies with SIGABRT ("terminate called without an active exception") after a successful
  run; seen once in 17 TP2xDP2 ``--exit-interval`` runs here (pytorch/pytorch#190489). An
  ``atexit`` handler destroys the process groups while the interpreter is alive, bounded by
  ``EXIT_DESTROY_TIMEOUT_S`` so a hung peer cannot hold the exit.
"""

from __future__ import annotations

import collections.abc
import functools
import math
import sys
import threading
import types
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.parallel.distributed as torch_ddp
import torch.utils.data as torch_data

from .journal import Journal
from .scope import called_from_megatron

EXIT_DESTROY_TIMEOUT_S = 10.0

_NUMPY_ALIASES = {"float": float, "int": int, "bool": bool, "object": object, "str": str,
                  "long": int}


def _six_module() -> types.ModuleType:
    six = types.ModuleType("torch._six")
    six.__doc__ = "torch._six stand-in installed by mindio_ttp.cpu_adaptor (removed in torch 2.0)"
    six.inf = math.inf
    six.nan = math.nan
    six.string_classes = (str, bytes)
    six.int_classes = int
    six.container_abcs = collections.abc
    return six


def _load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        if "weights_only" not in kwargs and called_from_megatron():
            kwargs["weights_only"] = False
        return original(*args, **kwargs)

    return load


def _ddp_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, module: Any, device_ids: Any = None, output_device: Any = None,
                 *args: Any, **kwargs: Any) -> None:
        if called_from_megatron():
            device_ids, output_device = None, None
        original(self, module, device_ids, output_device, *args, **kwargs)

    return __init__


def _dataloader_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("generator") is None and called_from_megatron():
            kwargs["generator"] = torch.Generator().manual_seed(0)
        original(self, *args, **kwargs)

    return __init__


def destroy_process_groups_at_exit() -> None:
    """Destroy the default process group (and its subgroups) if it is still alive."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True,
                              name="cpu-adaptor-destroy-pg")
    worker.start()
    worker.join(EXIT_DESTROY_TIMEOUT_S)
    if worker.is_alive():
        print(f"[cpu_adaptor] destroy_process_group did not finish in "
              f"{EXIT_DESTROY_TIMEOUT_S:.0f}s at exit; exiting anyway", file=sys.stderr,
              flush=True)


def install(journal: Journal) -> None:
    """Paper over the API changes listed in the module docstring."""
    if "torch._six" not in sys.modules:
        six = _six_module()
        journal.add_module(six)
        journal.setattr(torch, "_six", six)
    for alias, typ in _NUMPY_ALIASES.items():
        if alias not in np.__dict__:
            journal.setattr(np, alias, typ)
    journal.wrap(torch, "load", _load)
    journal.wrap(torch_ddp.DistributedDataParallel, "__init__", _ddp_init)
    if not hasattr(torch.storage.TypedStorage, "_untyped"):
        journal.setattr(torch.storage.TypedStorage, "_untyped",
                        torch.storage.TypedStorage.untyped)
    journal.wrap(torch_data.DataLoader, "__init__", _dataloader_init)
    journal.atexit(destroy_process_groups_at_exit)
