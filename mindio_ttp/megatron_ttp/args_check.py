"""Megatron arguments the dying checkpoint cannot work with, refused as plain errors.

Kept apart from the optimizer (no torch, no megatron import) so that the patched
`get_megatron_optimizer` can call it first thing (ttp-patch's edit 3.3): a forgotten flag then
stops the run before data loading and before train() starts the TTP controller, whose fault
flow would otherwise report it as a failed save (exit 84).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

NEEDS_REPLICATED = (
    "mindio_ttp: the dying checkpoint needs Megatron's --use-distributed-optimizer (the patched "
    "tree then builds ReplicatedOptimizer, which keeps every optimizer shard on two DP ranks); "
    "got {kind}. Add --use-distributed-optimizer, or run the unpatched tree (`ttp-patch revert`)."
)
NO_RANDOM_INIT = (
    "mindio_ttp: --data-parallel-random-init is not supported by the dying checkpoint (it saves "
    "one RNG state per DP rank, the chosen ranks hold only their own); drop the flag"
)


def check_args(args: Any) -> None:
    """Raise RuntimeError, saying what to change, for arguments the dying checkpoint refuses."""
    if not args.use_distributed_optimizer:
        kind = "Float16OptimizerWithFloat16Params" if (args.fp16 or args.bf16) else "FP32Optimizer"
        raise RuntimeError(NEEDS_REPLICATED.format(kind=kind))
    if getattr(args, "data_parallel_random_init", False):
        raise RuntimeError(NO_RANDOM_INIT)


def empty_cache_warning(args: Any, releases_gil: Callable[[], Optional[bool]]) -> Optional[str]:
    """A warning when Megatron will call ``torch.cuda.empty_cache()`` every step
    (``--empty-unused-memory-level`` 1 or 2, training.py:421-422, 459-460) and this torch's
    empty_cache holds the GIL while it waits for the device (`releases_gil()` False, measured by
    compat.features.empty_cache_releases_gil): behind a collective hung on a dead peer it would
    stop this rank's TTP heartbeats, and the rank would be taken for dead (D10)."""
    if getattr(args, "empty_unused_memory_level", 0) < 1 or releases_gil() is not False:
        return None
    return ("mindio_ttp: this torch's torch.cuda.empty_cache() holds the GIL while it waits for "
            "the device, and --empty-unused-memory-level "
            f"{args.empty_unused_memory_level} calls it every step: behind a collective hung on "
            "a dead peer it stops this rank's TTP heartbeats and the rank is taken for dead. "
            "Drop the flag (or use a torch whose empty_cache releases the GIL)")
