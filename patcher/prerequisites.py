"""What the runtime needs from files the edits do not change, checked before apply writes.

Edit 3.2 makes Megatron build `mindio_ttp.megatron_ttp.ReplicatedOptimizer` where it built
`DistributedOptimizer`. ReplicatedOptimizer subclasses that class and is called with its
arguments, so a tree whose `DistributedOptimizer.__init__` takes other ones patches cleanly,
compiles, and then dies with a TypeError on every rank when Megatron builds the optimizer,
after the model is built and the data loaded. The commit survey (docs/commit-survey.md) found
such trees: Megatron-LM before 57bfa7caba (2022-09-30, "Perform distributed optimizer's
all-gather in param dtype") passes no `params_dtype` and has no param buffers, which the
striped optimizer's all-gather writes into. apply refuses them here, saying why.
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


def read(root: Path) -> Optional[bytes]:
    """DISTRIB_OPTIMIZER's bytes in the work tree at `root` (only read: None when absent)."""
    try:
        return (root / DISTRIB_OPTIMIZER).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def constructor_args(source: bytes, cls: str = "DistributedOptimizer") -> Optional[Tuple[str, ...]]:
    """The positional parameters of `cls.__init__` after self; None when there is no such
    class or method (or the file does not parse)."""
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    names = [a.arg for a in (*item.args.posonlyargs, *item.args.args)]
                    return tuple(names[1:])
    return None


def check(current: Optional[bytes]) -> None:
    """Refuse a tree whose DistributedOptimizer ReplicatedOptimizer cannot subclass.
    `current`: the bytes of DISTRIB_OPTIMIZER in the work tree (None: absent)."""
    if current is None:
        raise MissingTarget(
            f"{DISTRIB_OPTIMIZER} is missing from the work tree: the runtime's "
            "ReplicatedOptimizer subclasses its DistributedOptimizer",
            f"restore it: git checkout -- {DISTRIB_OPTIMIZER}",
        )
    found = constructor_args(current)
    if found == CONSTRUCTOR_ARGS:
        return
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
