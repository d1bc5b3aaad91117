"""What a checkpoint of step t needs that the live objects only reach later in iteration t.

The patched train_step calls `increase_step()` right after `optimizer.step()`, inside the update
window; the dying checkpoint of that step may be written after the loop moved on (consumed
samples and the scheduler advance a few lines later, the RNG advances in the next forward). So
the optimizer keeps a small record per step: consumed samples, the scheduler's step count (it
counts only successful updates) and the RNG state, the last two steps only.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron import get_args, get_num_microbatches
from megatron.core import tensor_parallel


class StepRecord:
    """Mixin for ReplicatedOptimizer: `current_step`, `increase_step`, the per-step record."""

    current_step: int = 0

    def _init_step_record(self) -> None:
        self.current_step = 0
        self._step_meta: dict = {}
        self._sched_base = 0  # scheduler num_steps when training started
        self._sched_increments = 0
        self._last_found_inf = False
        self._memory_reported = False

    def increase_step(self) -> None:
        """Called by the patched train_step right after step(). Records what a checkpoint of
        the new step needs but the live objects reach only later in the iteration: consumed
        samples, the scheduler's step count, and the RNG state (unused until the next step)."""
        self.current_step += 1
        if not self._memory_reported:
            self._memory_reported = True
            print(self.memory_report(), flush=True)
        args = get_args()
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        if not self._last_found_inf:
            self._sched_increments += increment
        self._step_meta[self.current_step] = {
            "consumed_train_samples": args.consumed_train_samples + increment,
            "consumed_valid_samples": args.consumed_valid_samples + valid_increment(
                args, self.current_step, get_num_microbatches()),
            "scheduler_num_steps": self._sched_base + self._sched_increments,
            "rng_state": local_rng_state(),
        }
        for old in [s for s in self._step_meta if s < self.current_step - 1]:
            del self._step_meta[old]

    def record_loaded_step(self, iteration: int, scheduler) -> None:
        """After a load: the loaded iteration is the current step and can be re-saved."""
        args = get_args()
        self.current_step = iteration
        self._sched_base = scheduler.num_steps if scheduler is not None else 0
        self._sched_increments = 0
        self._step_meta = {iteration: {
            "consumed_train_samples": args.consumed_train_samples,
            "consumed_valid_samples": args.consumed_valid_samples,
            "scheduler_num_steps": self._sched_base,
            "rng_state": local_rng_state(),
        }}

    def step_meta(self, step: int) -> dict:
        if step not in self._step_meta:
            raise RuntimeError(f"no record of step {step} on this rank (it knows "
                               f"{sorted(self._step_meta)}): cannot checkpoint it")
        return self._step_meta[step]


def valid_increment(args, iteration: int, num_microbatches: int) -> int:
    """Validation samples the evaluation of `iteration` consumes, if that iteration evaluates.

    Megatron's loop evaluates at ``iteration % eval_interval == 0`` before it saves
    (``training.py:712-734``), and ``evaluate`` adds one global batch per eval iteration
    (``:806-808``); so its own checkpoint of that iteration counts that evaluation as done.
    The dying checkpoint of the iteration must say the same, whether or not the survivors got
    through the evaluation before the fault.
    """
    if not (args.eval_interval and iteration % args.eval_interval == 0
            and getattr(args, "do_valid", False)):
        return 0
    return (args.eval_iters * args.data_parallel_size * args.micro_batch_size
            * num_microbatches)


def local_rng_state() -> dict:
    """Megatron's get_rng_state() for this rank only (no all-gather: safe in any thread)."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
