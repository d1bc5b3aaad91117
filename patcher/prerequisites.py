"""What the runtime needs from files the edits do not change, checked before apply writes.

Edit 3.2 makes Megatron build `mindio_ttp.megatron_ttp.ReplicatedOptimizer` where it built
`DistributedOptimizer`. ReplicatedOptimizer subclasses that class and is called with its
arguments, so a tree whose `DistributedOptimizer.__init__` takes other ones patches cleanly,
compiles, and then dies with a TypeError on every rank when Megatron builds the optimizer,
after the model is built and the data loaded. The commit survey (docs/commit-survey.md) found
such trees: Megatron-LM before 57bfa7caba (2022-09-30, "Perform distributed optimizer's
all-gather in param dtype") passes no `params_dtype` and has no param buffers, which the
striped optimizer's all-gather writes into; from 49e4bd6857 (2023-05-24, "Distributed optimizer
DP-independent checkpoint") `build_optimizer_group_ranges`, which ReplicatedOptimizer calls to
build its partner's stripe, returns a pair, and the optimizer's checkpoint is a new,
DP-independent file that the dying save does not write. apply refuses both, saying why.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional, Tuple

from .errors import IncompatibleTree, MissingTarget

DISTRIB_OPTIMIZER = "megatron/optimizer/distrib_optimizer.py"
# The arguments ReplicatedOptimizer takes and hands to DistributedOptimizer, in order
# (mindio_ttp/megatron_ttp/replicated_optimizer.py; a test keeps the two in step).
CONSTRUCTOR_ARGS: Tuple[str, ...] = (
    "optimizer", "clip_grad", "log_num_zeros_in_grad", "params_have_main_grad",
    "use_contiguous_buffers_in_local_ddp", "fp16", "bf16", "params_dtype", "grad_scaler",
    "models",
)
ADDED_BY = "57bfa7caba (2022-09-30)"
CHANGED_BY = "49e4bd6857 (2023-05-24)"
GROUP_RANGES = "build_optimizer_group_ranges"


def read(root: Path) -> Optional[bytes]:
    """DISTRIB_OPTIMIZER's bytes in the work tree at `root` (only read: None when absent)."""
    try:
        return (root / DISTRIB_OPTIMIZER).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _class(module: ast.Module, name: str) -> Optional[ast.ClassDef]:
    return next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _method(cls: Optional[ast.ClassDef], name: str) -> Optional[ast.FunctionDef]:
    if cls is None:
        return None
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name),
                None)


def _parse(source: bytes) -> Optional[ast.Module]:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def constructor_args(source, cls: str = "DistributedOptimizer") -> Optional[Tuple[str, ...]]:
    """The positional parameters of `cls.__init__` after self; None when there is no such
    class or method (or the file does not parse). `source`: bytes, or a parsed module."""
    module = source if isinstance(source, ast.Module) else _parse(source)
    init = _method(_class(module, cls), "__init__") if module is not None else None
    if init is None:
        return None
    return tuple(a.arg for a in (*init.args.posonlyargs, *init.args.args))[1:]


def returns_pair(source) -> Optional[bool]:
    """Whether DistributedOptimizer.build_optimizer_group_ranges returns a tuple (49e4bd6857
    on) rather than the list of group ranges (285068c); None when there is no such method."""
    module = source if isinstance(source, ast.Module) else _parse(source)
    fn = _method(_class(module, "DistributedOptimizer"), GROUP_RANGES) if module else None
    if fn is None:
        return None
    return any(isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)
               for n in ast.walk(fn))


def check(current: Optional[bytes]) -> None:
    """Refuse a tree whose DistributedOptimizer ReplicatedOptimizer cannot subclass.
    `current`: the bytes of DISTRIB_OPTIMIZER in the work tree (None: absent)."""
    if current is None:
        raise MissingTarget(
            f"{DISTRIB_OPTIMIZER} is missing from the work tree: the runtime's "
            "ReplicatedOptimizer subclasses its DistributedOptimizer",
            f"restore it: git checkout -- {DISTRIB_OPTIMIZER}",
        )
    module = _parse(current)
    found = constructor_args(module) if module is not None else None
    if found != CONSTRUCTOR_ARGS:
        if found is None:
            what = "has no DistributedOptimizer.__init__ that ttp-patch can read"
        else:
            missing = [a for a in CONSTRUCTOR_ARGS if a not in found]
            what = (f"DistributedOptimizer.__init__ takes ({', '.join(found)})"
                    + (f", without {', '.join(missing)}" if missing else ""))
        raise IncompatibleTree(
            f"{DISTRIB_OPTIMIZER}: {what}; the runtime's ReplicatedOptimizer subclasses it and "
            f"passes ({', '.join(CONSTRUCTOR_ARGS)}), as Megatron-LM from {ADDED_BY} to 285068c "
            "does, so every rank would stop with a TypeError when Megatron builds the optimizer",
            "use a Megatron-LM commit that contains 57bfa7caba (285068c does); this one predates "
            "the distributed optimizer's param buffers that ReplicatedOptimizer writes into",
        )
    pair = returns_pair(module)
    if pair is None or pair:
        what = (f"has no DistributedOptimizer.{GROUP_RANGES}" if pair is None else
                f"DistributedOptimizer.{GROUP_RANGES} returns a pair (Megatron-LM {CHANGED_BY}, "
                "the DP-independent optimizer checkpoint)")
        raise IncompatibleTree(
            f"{DISTRIB_OPTIMIZER}: {what}; the runtime's ReplicatedOptimizer builds its "
            f"partner's stripe with it as 285068c has it, and writes 285068c's optimizer "
            "checkpoint files, so every rank would stop when Megatron builds the optimizer",
            f"use a Megatron-LM commit before {CHANGED_BY.split()[0]} (285068c is one); the "
            "DP-independent optimizer checkpoint is not supported yet",
        )
