"""`load_checkpoint`: Megatron's loader, after refusing checkpoints that are not whole.

A dying checkpoint is written while the job is failing; if the writers died too, or a file was
damaged later, Megatron would crash in torch.load or (worse) `sys.exit()` with status 0. So the
ranks first agree on the newest checkpoint that passes `manifest.verify` on every rank (each rank
re-hashes a share of the files; the steps tried are agreed too, not read from each rank's own
directory listing), then let Megatron load exactly that one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, List, Optional

import torch
from megatron import checkpointing, get_args, print_rank_0
from megatron.core import mpu

from mindio_ttp.faulttime import manifest
from mindio_ttp.megatron_ttp import log_record, rejoin
from mindio_ttp.megatron_ttp.args_check import NEEDS_REPLICATED
from mindio_ttp.megatron_ttp.replicated_optimizer import ReplicatedOptimizer, loading_from
from mindio_ttp.megatron_ttp.save import parallel_layout

tensor_rank = mpu.get_tensor_model_parallel_rank
pipeline_rank = mpu.get_pipeline_model_parallel_rank


def require_replicated(optimizer) -> None:
    if not isinstance(optimizer, ReplicatedOptimizer):
        raise RuntimeError(NEEDS_REPLICATED.format(kind=type(optimizer).__name__))


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg: str = "load",
                    strict: bool = True) -> int:
    """Drop-in for megatron.checkpointing.load_checkpoint with validation and fallback; during
    an in-memory recovery, the state comes from memory instead (refill.py)."""
    require_replicated(optimizer)
    if rejoin.current() is not None:
        from mindio_ttp.megatron_ttp.refill import load_in_memory

        return load_in_memory(model, optimizer, opt_param_scheduler)
    args = get_args()
    if getattr(args, load_arg) is None:
        optimizer.record_loaded_step(0, opt_param_scheduler)
        return 0
    load_dir = Path(getattr(args, load_arg))
    step = choose_checkpoint(load_dir)
    iter_dir = None if step is None else load_dir / manifest.iter_dir_name(step)
    par, tp, pp = parallel_layout(), tensor_rank(), pipeline_rank()
    # the partner stripe is read from the partner's stock file of the same checkpoint
    with _pinned_iteration(step), loading_from(iter_dir, lambda dp: par.optim_file(tp, pp, dp)):
        iteration = checkpointing.load_checkpoint(model, optimizer, opt_param_scheduler,
                                                  load_arg=load_arg, strict=strict)
    optimizer.record_loaded_step(iteration, opt_param_scheduler)
    if iter_dir is not None:
        _log_the_saved_step(iter_dir, iteration, model, optimizer)
    return iteration


def _log_the_saved_step(iter_dir: Path, iteration: int, model, optimizer) -> None:
    """A dying checkpoint's step whose log line or scalars no run wrote (log_record.py): every
    rank reads the record the manifest lists (verified with the checkpoint), and all write it
    with Megatron's own training_log, or none does (its collectives need every rank)."""
    rec = None
    try:
        entry = manifest.listed(iter_dir, parallel_layout(), manifest.STEP_LOG)
        if entry is not None:
            state = torch.load(iter_dir / manifest.STEP_LOG, map_location="cpu",
                               weights_only=True)
            rec = log_record.from_checkpoint(state, iteration)
    except (OSError, ValueError, RuntimeError, EOFError) as exc:  # what torch.load raises
        print(f"mindio_ttp: rank {torch.distributed.get_rank()}: the log record of iteration "
              f"{iteration} in {iter_dir} is not usable ({exc}); its log line is not written "
              "again", flush=True)
    wanted = rec is not None and log_record.wanted_after_load(rec)
    if _agreed(1 if wanted else 0, torch.distributed.ReduceOp.MIN) == 1:
        last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        log_record.after_load(rec, last, model, optimizer)  # type: ignore[arg-type]


def choose_checkpoint(load_dir: Path) -> Optional[int]:
    """The newest usable checkpoint, agreed by all ranks; None when no rank has a tracker (or
    every tracker says `release`): Megatron then does what it always did. A tracker that says
    anything else raises `manifest.TrackerError` before Megatron's own reader would
    `sys.exit(0)`.

    Each rank sees the checkpoint directory through its own listing, and listings differ (a
    shared filesystem's attribute cache, a node that lost its mount for a moment). So no rank
    walks its own list: in each round every rank proposes the newest step of its list below
    the last one tried, the ranks take the largest proposal (MAX), every rank checks that one
    step (`manifest.verify`: files, sizes, its share of the sha256s), and the step is taken
    only if every rank accepts it (MIN). All ranks try the same steps in the same order and
    take the same one, or all raise."""
    newest, _reason = manifest.read_tracker(load_dir)
    mine: List[int] = [] if newest is None else sorted(
        {newest, *manifest.candidate_steps(load_dir, newest)}, reverse=True)
    par = parallel_layout()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    share = (par.expected_files() + list(manifest.OPTIONAL_FILES))[rank::world]
    top = _agreed(newest if newest is not None else -1, torch.distributed.ReduceOp.MAX)
    if top < 0:
        return None
    tried: Optional[int] = None
    while True:
        proposal = next((s for s in mine if tried is None or s < tried), -1)
        step = _agreed(proposal, torch.distributed.ReduceOp.MAX)
        if step < 0:
            raise RuntimeError(f"mindio_ttp: no usable checkpoint in {load_dir} (newest tracker "
                               f"says {top}); remove the tracker file to start from scratch")
        iter_dir = load_dir / manifest.iter_dir_name(step)
        reason = manifest.verify(iter_dir, par, hash_files=share)
        if reason:
            print(f"mindio_ttp: rank {rank} refuses checkpoint {iter_dir}: {reason}", flush=True)
        if _agreed(0 if reason else 1, torch.distributed.ReduceOp.MIN) == 1:
            if step != top:
                print_rank_0(f"mindio_ttp: {manifest.TRACKER} names iteration {top}, which is "
                             f"not usable; loading the previous complete checkpoint, iteration "
                             f"{step}")
            return step
        print_rank_0(f"mindio_ttp: checkpoint {iter_dir} refused (see the rank messages above)")
        tried = step


def _agreed(value: int, op) -> int:
    """`value` reduced over every rank with `op`, on the default group and Megatron's device
    (NCCL and HCCL take no CPU tensors): Megatron's idiom, torch.cuda.current_device(), which
    the device adaptor maps to the NPU and the CPU adaptor to the CPU."""
    t = torch.tensor([value], dtype=torch.int64, device=torch.cuda.current_device())
    torch.distributed.all_reduce(t, op=op)
    return int(t.item())


@contextlib.contextmanager
def _pinned_iteration(step: Optional[int]) -> Iterator[None]:
    """Make Megatron's loader read `step` instead of the tracker's (possibly refused) value."""
    if step is None:
        yield
        return
    original = checkpointing.read_metadata
    checkpointing.read_metadata = lambda _tracker: (step, False)
    try:
        yield
    finally:
        checkpointing.read_metadata = original
