"""The end of a Megatron job: the runtime protects `pretrain` up to its final save, not only
`train()` (issue 23).

Megatron-LM 285068c's `pretrain` goes on after `train()` returns: the final evaluation
(`--eval-iters`, on the validation set), then the final `save_checkpoint(iteration, ...)`,
then the test evaluation. The guide's `@ttp_to_persist` on `train` shuts the runtime down at
train()'s return, so a rank lost in the final save left a checkpoint without some of its files,
no tracker, and no dying checkpoint: the whole job was lost. Now:

* `@mega.in_memory_recovery` on `pretrain` (edit 2.9) holds the runtime (`hooks.HELD`): a
  fault in the final evaluation or the final save is a fault like one in training (an
  in-memory recovery, whose re-run of pretrain trains no step and saves the final state again,
  or the dying checkpoint of the last step, which replaces the save the fault cut short);
* `mega.final_checkpoint_saved(iteration)` (edit 2.11) right after that final save: Megatron's
  `save_checkpoint` ends with a barrier of every rank after rank 0 marked the checkpoint latest,
  so past it the job's state is on disk, complete on every rank. It tells this node's `ttprun`
  (a worker lost from here on fails nothing: the job succeeds) and stops the runtime;
* without `--save` there is no final save: the runtime stops when `pretrain` returns.
"""

from __future__ import annotations

from pathlib import Path

from mindio_ttp import hooks


def final_checkpoint_saved(iteration: int) -> None:
    """Edit 2.11: pretrain's final save of `iteration` is complete on every rank."""
    from megatron import get_args

    from mindio_ttp import framework_ttp as ttp
    from mindio_ttp.faulttime import manifest

    save = get_args().save
    where = str((Path(save) / manifest.iter_dir_name(iteration)).absolute()) if save else ""
    hooks.TRAINING.leave()
    hooks.HELD = False
    ttp.ttp_job_complete(iteration, where)


def hold_runtime() -> None:
    """From pretrain's start: train()'s normal return leaves the runtime up."""
    hooks.HELD = True


def release_runtime() -> None:
    """pretrain returned: stop the runtime if the final save did not (no --save)."""
    hooks.TRAINING.leave()
    hooks.HELD = False
    rt = hooks.RUNTIME
    if rt is not None:
        rt.shutdown()
