"""``torch.cuda`` as Megatron uses it, answered by the CPU.

Every function replaced here checks its direct caller (:mod:`mindio_ttp.compat.scope`): Megatron
code gets the CPU answer, anyone else gets stock torch (on a CPU build that is usually "not
compiled with CUDA"). The legacy typed-tensor classes are attributes, not calls, so they are
mapped for all.

Patches (Megatron-LM 285068c file:line they serve):

* ``is_available`` -> True: ``initialize.py:37`` asserts it.
* ``device_count`` -> 1: with 0, ``initialize.py:151,183-192`` silently skips
  ``mpu.initialize_model_parallel`` and ``:216-217`` the model-parallel seeding.
* ``current_device`` -> ``torch.device('cpu')``: passed as ``device=`` in ~40 places, e.g.
  ``core/tensor_parallel/layers.py:185,289,479,491,648,658``, ``mappings.py:101,121``,
  ``model/distributed.py:23``, ``timers.py:189``, ``training.py:280,288``.
* ``set_device`` (``initialize.py:172``), ``synchronize`` (``timers.py:84,94``,
  ``p2p_communication.py:88,231``), ``empty_cache`` (``initialize.py:300``,
  ``training.py:422,460,797``) -> no-ops.
* ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``initial_seed`` -> the CPU default
  generator: ``core/tensor_parallel/random.py:108-133,170,191-239``,
  ``checkpointing.py:187,592,602``. ``manual_seed_all`` stays stock (torch.manual_seed calls it).
* ``memory_allocated/reserved``, ``max_memory_*``, ``memory_stats`` -> process RSS / peak RSS:
  ``utils.py:86-92``, ``training.py:584``.
* ``torch.cuda.{Float,Double,Half,BFloat16,Long,Int,...}Tensor`` -> the CPU classes:
  constructors at ``training.py:98,499,623,740,921,924``, ``optimizer/grad_scaler.py:16,65-71``,
  ``optimizer/optimizer.py:358,366,370,706``, ``optimizer/clip_grads.py:60,69,81,100,118``,
  ``utils.py:54``, ``data/gpt_dataset.py:368``, ``core/tensor_parallel/data.py:38``,
  ``checkpointing.py:160``; ``isinstance`` tuples at ``model/module.py:13-15``.
* ``Tensor.cuda()`` / ``Module.cuda()`` -> identity: ``training.py:280``,
  ``core/tensor_parallel/data.py:86``, ``optimizer/grad_scaler.py:118``, ``model/module.py:116``.
* ``Tensor.type()`` without arguments -> ``'torch.cuda.FloatTensor'`` style names for CPU
  tensors: asserted at ``optimizer/clip_grads.py:49``, branched on at
  ``optimizer/distrib_optimizer.py:285-306`` and ``optimizer/optimizer.py:525-544``.
"""

from __future__ import annotations

import functools
import os
import resource
from typing import Any, Callable, Dict

import torch

from mindio_ttp.compat.journal import Journal
from mindio_ttp.compat.scope import called_from_megatron

_TYPED_TENSORS = (
    "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
    "IntTensor", "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor",
)


def rss_bytes() -> int:
    """Resident set size of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_stats(device: Any = None) -> Dict[str, int]:
    now = rss_bytes()
    return {
        "allocated_bytes.all.current": now,
        "reserved_bytes.all.current": now,
        "allocated_bytes.all.peak": peak_rss_bytes(),
        "allocation.all.current": 0,
    }


def _scoped(original: Callable[..., Any], cpu: Callable[..., Any]) -> Callable[..., Any]:
    """A function that runs ``cpu`` for Megatron callers and ``original`` for everyone else."""

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if called_from_megatron():
            return cpu(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__wrapped_cpu__ = cpu  # type: ignore[attr-defined]
    return dispatch


def _cpu_functions() -> Dict[str, Callable[..., Any]]:
    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: torch.device("cpu"),
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "initial_seed": lambda: torch.default_generator.initial_seed(),
        "memory_allocated": lambda device=None: rss_bytes(),
        "memory_reserved": lambda device=None: rss_bytes(),
        "max_memory_allocated": lambda device=None: peak_rss_bytes(),
        "max_memory_reserved": lambda device=None: peak_rss_bytes(),
        "memory_stats": _memory_stats,
    }


def _tensor_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        if called_from_megatron():
            return self
        return original(self, *args, **kwargs)

    return cuda


def _tensor_type(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if (
            not args and not kwargs and isinstance(name, str) and self.device.type == "cpu"
            and name.startswith("torch.") and not name.startswith("torch.cuda.")
            and called_from_megatron()
        ):
            return "torch.cuda." + name[len("torch."):]
        return name

    return type_


def install(journal: Journal) -> None:
    """Map the ``torch.cuda`` surface Megatron touches onto the CPU."""
    for name, cpu in _cpu_functions().items():
        journal.wrap(torch.cuda, name, lambda orig, cpu=cpu: _scoped(orig, cpu))
    for name in _TYPED_TENSORS:
        journal.setattr(torch.cuda, name, getattr(torch, name))
    journal.wrap(torch.Tensor, "cuda", _tensor_cuda)
    journal.wrap(torch.nn.Module, "cuda", _tensor_cuda)
    journal.wrap(torch.Tensor, "type", _tensor_type)
