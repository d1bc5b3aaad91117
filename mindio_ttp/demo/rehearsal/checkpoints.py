"""Bit-exact comparison of two Megatron checkpoints at one iteration.

Every ``.pt`` file under ``iter_XXXXXXX/`` of both directories is loaded and walked; tensors
(model, optimizer state, RNG states) must be ``torch.equal``, numpy arrays ``array_equal``, and
other leaves (iteration, python/numpy RNG tuples, scheduler state) ``==``. The top-level ``args``
entry is skipped for the leaf comparison: it legitimately differs between an uninterrupted and a
resumed run (``--load``, ``--exit-interval``). Megatron classes pickled in a checkpoint (e.g.
``megatron.model.enums.ModelType``) are read as opaque placeholders, so comparing needs no
Megatron import and can run in the test process.
"""

from __future__ import annotations

import pickle
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import torch

from mindio_ttp.faulttime.manifest import iter_dir_name

SKIPPED_TOP_KEYS = ("args",)


class _Opaque:
    """Placeholder for a class from a module that is not imported here."""

    _qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"<{self._qualname} {self.args!r}>"


_placeholders: Dict[Tuple[str, str], type] = {}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "megatron" or module.startswith("megatron."):
            key = (module, name)
            if key not in _placeholders:
                _placeholders[key] = type(name, (_Opaque,), {"_qualname": f"{module}.{name}"})
            return _placeholders[key]
        return super().find_class(module, name)


_pickle_module = types.ModuleType("ttp_checkpoint_pickle")
_pickle_module.Unpickler = _Unpickler  # type: ignore[attr-defined]
_pickle_module.load = pickle.load  # type: ignore[attr-defined]


def load_checkpoint_file(path: Path) -> Any:
    """``torch.load`` a Megatron checkpoint file without importing Megatron."""
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_pickle_module)


def leaves(obj: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, obj


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and np.array_equal(a, b))
    return type(a) is type(b) and a == b


@dataclass
class CheckpointComparison:
    """What differs between two checkpoints; ``bit_exact`` when nothing does."""

    files: List[str] = field(default_factory=list)
    tensors: int = 0
    leaves: int = 0
    differing: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)

    @property
    def bit_exact(self) -> bool:
        return bool(self.files) and not self.differing and not self.missing

    def summary(self) -> str:
        verdict = "BIT-EXACT" if self.bit_exact else "DIFFERENT"
        text = (f"{len(self.files)} files, {self.tensors} tensors, {self.leaves} leaves: "
                f"{verdict}")
        problems = self.missing[:10] + self.differing[:10]
        return text + "".join(f"\n  {p}" for p in problems)


def compare_checkpoints(a: Path, b: Path, iteration: int) -> CheckpointComparison:
    """Compare ``a/iter_N`` with ``b/iter_N`` leaf by leaf (see the module docstring)."""
    sub = iter_dir_name(iteration)
    result = CheckpointComparison()
    files_a = sorted(p.relative_to(a) for p in (Path(a) / sub).glob("*/*.pt"))
    files_b = sorted(p.relative_to(b) for p in (Path(b) / sub).glob("*/*.pt"))
    result.missing += [f"file only in {a}: {f}" for f in files_a if f not in files_b]
    result.missing += [f"file only in {b}: {f}" for f in files_b if f not in files_a]
    for rel in (f for f in files_a if f in files_b):
        result.files.append(str(rel))
        left = dict(leaves(load_checkpoint_file(Path(a) / rel)))
        right = dict(leaves(load_checkpoint_file(Path(b) / rel)))
        for key in sorted(set(left) | set(right)):
            if key.split("/")[1] in SKIPPED_TOP_KEYS:
                continue
            if key not in left or key not in right:
                result.missing.append(f"{rel}:{key} only in {'a' if key in left else 'b'}")
                continue
            result.leaves += 1
            result.tensors += isinstance(left[key], torch.Tensor)
            if not _equal(left[key], right[key]):
                result.differing.append(f"{rel}:{key}")
    return result
