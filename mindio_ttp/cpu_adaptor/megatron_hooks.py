"""Post-import hooks on Megatron modules, and the modules Megatron imports but CPU lacks.

A meta-path finder placed first on ``sys.meta_path`` wraps the loader of a few Megatron modules
so one attribute is replaced right after the module body ran, before any
``from module import name`` elsewhere can bind the original. Megatron's files are not edited.

Hooks (Megatron-LM 285068c file:line):

* ``megatron.fused_kernels.load`` -> no-op: ``initialize.py:125-132`` always calls it and it
  runs ``nvcc`` (``fused_kernels/__init__.py:21,101``) and builds the CUDA layer norm
  (``:84-88``) whatever the fusion flags say.
* ``megatron.initialize.set_jit_fusion_options`` -> no-op: it turns on nvfuser
  (``initialize.py:241-260``) and warms up on ``device='cuda'`` (``:268-289``); called from
  ``training.py:92``. TorchScript defaults stay, ``@torch.jit.script`` functions run on CPU.
* ``megatron.core.tensor_parallel.random._set_cuda_rng_state`` -> sets the CPU default
  generator. The original (``random.py:31-62``) goes through ``torch.cuda._lazy_call``, which on
  a CPU build queues the call forever, so the RNG state would silently never be set.
* ``megatron.core.tensor_parallel.utils.gather_split_1d_tensor`` -> the same call under
  ``torch.no_grad()``: with the default ``--scatter-gather-tensors-in-pipeline`` pipeline
  parallelism gathers each received activation with it (``p2p_communication.py:237-248``), and
  gloo's ``_all_gather_base`` (``utils.py:83``) writes into no-grad views of the output, which
  autograd refuses in grad mode ("A view was created in no_grad mode and is being modified
  inplace"). The output is created with ``requires_grad=False`` (``utils.py:75-77``) and the
  caller turns grad on afterwards (``.view(shape).requires_grad_()``), so nothing changes.
* ``megatron.data.dataset_utils.compile_helper`` -> builds ``helpers.cpp`` out of tree
  (:mod:`.helpers_build`) instead of ``make`` in the checkout (``dataset_utils.py:83-92``,
  called at ``initialize.py:98-100``); ``megatron.data.helpers`` (imported at
  ``data/gpt_dataset.py:341``) is then loaded from that build.
* ``megatron.model.vision.knn_monitor`` -> a stub whose functions raise: ``training.py:42``
  imports it and it pulls in torchvision and PIL (``data/vit_dataset.py:5``); it is used only
  for DINO pretraining (``training.py:774``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from mindio_ttp.compat.journal import Journal

from .helpers_build import build_helpers

Hook = Callable[[ModuleType], None]
HELPERS_MODULE = "megatron.data.helpers"


def _hook_fused_kernels(mod: ModuleType) -> None:
    def load(args: Any) -> None:
        if getattr(args, "rank", 0) == 0:
            print("> [cpu_adaptor] fused CUDA kernels not built (CPU run)", flush=True)

    mod.load = load


def _hook_initialize(mod: ModuleType) -> None:
    def set_jit_fusion_options() -> None:
        return None

    mod.set_jit_fusion_options = set_jit_fusion_options


def _hook_random(mod: ModuleType) -> None:
    def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1) -> None:
        torch.default_generator.set_state(new_state)

    mod._set_cuda_rng_state = _set_cuda_rng_state


def _hook_tensor_parallel_utils(mod: ModuleType) -> None:
    original = mod.gather_split_1d_tensor

    def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return original(tensor)

    gather_split_1d_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    mod.gather_split_1d_tensor = gather_split_1d_tensor


def _hook_dataset_utils(mod: ModuleType) -> None:
    source = Path(mod.__file__).resolve().parent / "helpers.cpp"

    def compile_helper() -> None:
        build_helpers(source)

    mod.compile_helper = compile_helper


def _fill_knn_monitor(mod: ModuleType) -> None:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "megatron.model.vision.knn_monitor is a stub under mindio_ttp.cpu_adaptor "
            "(vision/DINO pretraining needs torchvision and is not supported on CPU)"
        )

    for name in ("compute_feature_bank", "get_feature_bank", "knn_predict",
                 "build_data_loader"):
        setattr(mod, name, unavailable)


HOOKS: Dict[str, Hook] = {
    "megatron.fused_kernels": _hook_fused_kernels,
    "megatron.initialize": _hook_initialize,
    "megatron.core.tensor_parallel.random": _hook_random,
    "megatron.core.tensor_parallel.utils": _hook_tensor_parallel_utils,
    "megatron.data.dataset_utils": _hook_dataset_utils,
}
STUBS: Dict[str, Hook] = {"megatron.model.vision.knn_monitor": _fill_knn_monitor}


class _HookedLoader(importlib.abc.Loader):
    """Runs the real loader, then the hook."""

    def __init__(self, inner: importlib.abc.Loader, hook: Hook) -> None:
        self._inner = inner
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_filename, ...
        return getattr(self._inner, name)


class _StubLoader(importlib.abc.Loader):
    def __init__(self, fill: Hook) -> None:
        self._fill = fill

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        self._fill(module)


class MegatronImportHooks(importlib.abc.MetaPathFinder):
    """Meta-path finder that applies :data:`HOOKS` and :data:`STUBS`."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith("megatron."):
            return None
        if fullname in STUBS:
            return importlib.util.spec_from_loader(fullname, _StubLoader(STUBS[fullname]))
        if fullname == HELPERS_MODULE:
            return self._helpers_spec(path)
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        spec = self._find_elsewhere(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader, hook)
        return spec

    def _find_elsewhere(self, fullname: str, path: Optional[Sequence[str]],
                        target: Optional[ModuleType]
                        ) -> Optional[importlib.machinery.ModuleSpec]:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    @staticmethod
    def _helpers_spec(path: Optional[Sequence[str]]) -> Optional[importlib.machinery.ModuleSpec]:
        for entry in path or ():
            source = Path(entry) / "helpers.cpp"
            if source.is_file():
                built = build_helpers(source, verbose=os.environ.get("RANK", "0") == "0")
                return importlib.util.spec_from_file_location(HELPERS_MODULE, built)
        return None


def install(journal: Journal) -> None:
    """Put the hook finder first on ``sys.meta_path``."""
    journal.prepend_meta_path(MegatronImportHooks())
