"""Megatron arguments the dying checkpoint cannot work with, refused as plain errors.

Kept apart from the optimizer (no torch, no megatron import) so that the patched
`get_megatron_optimizer` can call it first thing (ttp-patch's edit 3.3): a forgotten flag then
stops the run before data loading and before train() starts the TTP controller, whose fault
flow would otherwise report it as a failed save (exit 84).
"""

from __future__ import annotations

from typing import Any

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
