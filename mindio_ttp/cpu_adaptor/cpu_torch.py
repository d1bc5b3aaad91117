"""torch behaviour Megatron-LM 285068c relies on that holds on CUDA but not on CPU with gloo.

Not API drift (that is :mod:`mindio_ttp.compat`, for every device): these are answers a CPU
gives differently. "Scoped" patches only change Megatron's calls
(:mod:`mindio_ttp.compat.scope`).

* ``DistributedDataParallel`` (scoped): ``training.py:288-290`` (``--DDP-impl torch``) passes
  ``device_ids=[current_device()]``, which torch rejects for CPU modules; dropped.
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

import functools
import sys
import threading
from typing import Any, Callable

import torch
import torch.nn.parallel.distributed as torch_ddp
import torch.utils.data as torch_data

from mindio_ttp.compat.journal import Journal
from mindio_ttp.compat.scope import called_from_megatron

EXIT_DESTROY_TIMEOUT_S = 10.0


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
    """Apply the CPU answers listed in the module docstring."""
    journal.wrap(torch_ddp.DistributedDataParallel, "__init__", _ddp_init)
    journal.wrap(torch_data.DataLoader, "__init__", _dataloader_init)
    journal.atexit(destroy_process_groups_at_exit)
