"""The one place that asks the installed torch and numpy what they can do.

Every drift fix in :mod:`mindio_ttp.compat` is applied only where the answer here says it is
needed, and each answer is a feature check (does the attribute exist, what default does the
signature carry), never a version comparison: an NGC or Ascend build reports versions such as
``1.14.0a0+410ce96`` or ``2.1.0.post3`` whose number says little about which APIs it has.
:func:`torch_version` is there for reports only.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Callable, Dict, List, Tuple

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
