"""Megatron-LM 285068c glue for the dying checkpoint: the names the patched tree uses.

`import mindio_ttp.megatron_ttp as mega` happens at the top of megatron/training.py, before
megatron.optimizer exists, and megatron/optimizer/__init__.py imports ReplicatedOptimizer from
here while it is itself half-imported. So nothing is imported eagerly: each name loads its
module on first use (PEP 562 module __getattr__).

`ttp_save_checkpoint` is fetched once, when train() registers the handler, before the first
step: that is where a run without --use-distributed-optimizer is stopped with a clear message
instead of an AttributeError on `optimizer.current_step` inside train_step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReplicatedOptimizer", "load_checkpoint", "ttp_save_checkpoint", "rename_save_result"]


def __getattr__(name: str) -> Any:
    if name == "ReplicatedOptimizer":
        from .replicated_optimizer import ReplicatedOptimizer

        return ReplicatedOptimizer
    if name == "load_checkpoint":
        from .load import load_checkpoint

        return load_checkpoint
    if name == "ttp_save_checkpoint":
        _check_startup()
        from .save import ttp_save_checkpoint

        return ttp_save_checkpoint
    if name == "rename_save_result":
        from .save import rename_save_result

        return rename_save_result
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_startup() -> None:
    from megatron import get_args

    from .load import NEEDS_REPLICATED

    args = get_args()
    if not args.use_distributed_optimizer:
        kind = "Float16OptimizerWithFloat16Params" if (args.fp16 or args.bf16) else "FP32Optimizer"
        raise RuntimeError(NEEDS_REPLICATED.format(kind=kind))
    if args.save:  # faults are claimed beside the checkpoints: at most one save per fault
        from mindio_ttp.framework_ttp import ttp_set_checkpoint_dir

        ttp_set_checkpoint_dir(args.save)
    if getattr(args, "data_parallel_random_init", False):
        raise RuntimeError("mindio_ttp: --data-parallel-random-init is not supported by the dying "
                           "checkpoint (it saves one RNG state per DP rank, the chosen ranks "
                           "hold only their own); drop the flag")
