"""torch / numpy API drift that Megatron-LM 285068c (January 2023) trips over, on any device.

Megatron 285068c was written against the NGC 22.12 container (a torch 1.14 nightly, numpy
1.22). Each fix below is applied only when :mod:`.features` says the installed torch or numpy
needs it; "scoped" ones only change Megatron's own calls (:mod:`.scope`), so the launcher, the
TTP runtime and tests in the same process keep stock behaviour.

===========================  =================================================================
``torch._six``               removed in torch 2.0; ``optimizer/clip_grads.py:6`` imports
                             ``inf`` from it. A small module is registered in ``sys.modules``.
numpy aliases                ``np.float/int/bool/object/str/long``, removed in numpy 1.24:
                             ``data/indexed_dataset.py:98,271``; restored where missing.
``torch.load`` (scoped)      since torch 2.6 ``weights_only`` defaults to True and refuses the
                             pickled ``argparse.Namespace`` (and numpy RNG state) in every
                             checkpoint: ``checkpointing.py:399,401,413,414,650``. Megatron
                             calls get ``weights_only=False`` unless they pass it. The refusal
                             is caught at ``checkpointing.py:417-420`` and becomes
                             ``sys.exit()``: exit code 0 and no training, silently.
``TypedStorage._untyped``    ``optimizer/distrib_optimizer.py:391`` builds the param buffer
                             as a view of the grad buffer with it; the torch 1.13.1 release
                             and torch 2.x call it ``untyped``. Aliased where missing.
===========================  =================================================================
"""

from __future__ import annotations

import collections.abc
import functools
import math
import sys
import types
from typing import Any, Callable, List

import numpy as np
import torch

from . import features
from .journal import Journal
from .scope import called_from_megatron


def _six_module() -> types.ModuleType:
    six = types.ModuleType("torch._six")
    six.__doc__ = "torch._six stand-in installed by mindio_ttp.compat (removed in torch 2.0)"
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


def install(journal: Journal) -> List[str]:
    """Apply the fixes this torch and numpy need; return their names (empty: none needed)."""
    applied: List[str] = []
    if features.lacks_torch_six() and "torch._six" not in sys.modules:
        six = _six_module()
        journal.add_module(six)
        journal.setattr(torch, "_six", six)
        applied.append("torch._six")
    missing = features.missing_numpy_aliases()
    for alias in missing:
        journal.setattr(np, alias, features.NUMPY_ALIASES[alias])
    if missing:
        applied.append("numpy " + "/".join(f"np.{a}" for a in missing))
    if features.load_defaults_to_weights_only():
        journal.wrap(torch, "load", _load)
        applied.append("torch.load weights_only=False for Megatron")
    if features.lacks_typed_storage_untyped():
        journal.setattr(torch.storage.TypedStorage, "_untyped",
                        torch.storage.TypedStorage.untyped)
        applied.append("TypedStorage._untyped")
    return applied
