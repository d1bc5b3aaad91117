"""Megatron-LM 285068c glue for the dying checkpoint: the names the patched tree uses.

`import mindio_ttp.megatron_ttp as mega` happens at the top of megatron/training.py (and of
megatron/initialize.py, edit 6.1, for `process_group_timeout`), before megatron.optimizer
exists, and megatron/optimizer/__init__.py imports ReplicatedOptimizer from here while it is
itself half-imported. So nothing is imported eagerly: each name loads its module on first use
(PEP 562 module __getattr__).

A run without --use-distributed-optimizer is stopped where the optimizer is built
(`check_args`, called by ttp-patch's edit 3.3). For a tree patched by hand with only the guide's
edits the same check runs when train() fetches `ttp_save_checkpoint` to register it: later, and
inside the fault flow, but still before the first step.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ReplicatedOptimizer",
    "check_args",
    "load_checkpoint",
    "ttp_save_checkpoint",
    "rename_save_result",
    "in_memory_recovery",
    "reuse_on_recovery",
    "process_group_store",
    "process_group_timeout",
    "final_checkpoint_saved",
    "step_log",
    "step_losses",
]


def __getattr__(name: str) -> Any:
    if name == "ReplicatedOptimizer":
        from mindio_ttp.megatron_ttp.replicated_optimizer import ReplicatedOptimizer

        return ReplicatedOptimizer
    if name == "check_args":
        from mindio_ttp.megatron_ttp.args_check import check_args

        return check_args
    if name == "load_checkpoint":
        from mindio_ttp.megatron_ttp.load import load_checkpoint

        return load_checkpoint
    if name == "ttp_save_checkpoint":
        _check_startup()
        from mindio_ttp.megatron_ttp.save import ttp_save_checkpoint

        return ttp_save_checkpoint
    if name == "rename_save_result":
        from mindio_ttp.megatron_ttp.save import rename_save_result

        return rename_save_result
    if name in ("in_memory_recovery", "reuse_on_recovery", "process_group_store"):
        from mindio_ttp.megatron_ttp import rejoin

        return getattr(rejoin, name)
    if name == "final_checkpoint_saved":
        from mindio_ttp.megatron_ttp.completion import final_checkpoint_saved

        return final_checkpoint_saved
    if name in ("step_log", "step_losses"):
        from mindio_ttp.megatron_ttp import log_record

        return getattr(log_record, name)
    if name == "process_group_timeout":
        from mindio_ttp.megatron_ttp.timeout import process_group_timeout

        return process_group_timeout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_startup() -> None:
    from megatron import get_args

    from mindio_ttp.compat import features
    from mindio_ttp.megatron_ttp.args_check import check_args, empty_cache_warning

    args = get_args()
    check_args(args)
    warning = empty_cache_warning(args, features.empty_cache_releases_gil)
    if warning:
        import logging

        logging.getLogger("mindio_ttp").warning("%s", warning)
    if args.save:  # faults are claimed beside the checkpoints: at most one save per fault
        from mindio_ttp.framework_ttp import ttp_set_checkpoint_dir

        ttp_set_checkpoint_dir(args.save)
