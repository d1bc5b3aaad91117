"""One rank of the demo job; ``ttprun -m mindio_ttp.demo.job`` starts four of them.

The hook calls are the ones the patched Megatron makes, in the same places: controller on rank 0
and a processor on every rank inside ``train``, save/rename handlers registered, the gradient
exchange, grad-norm and the guide's barrier before ``ttp_start_updating_os``, nothing collective
inside the update window, the parameter all-gather after ``ttp_end_updating_os``, and
``ttp_set_ckpt_args`` once the iteration count has moved on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

import mindio_ttp.framework_ttp as ttp
from mindio_ttp.demo import checkpoint, recovery
from mindio_ttp.demo.faults import FaultPlan, Phase
from mindio_ttp.demo.model import (
    FullState,
    ShardLayout,
    ShardState,
    adam_update,
    assemble,
    clip,
    forward_backward,
    reduce_grads,
)
from mindio_ttp.megatron_ttp import exchange
from mindio_ttp.recovery.rank import RECOVERY

GUIDE_PORT = 8000  # the guide's literal; TTP_CONTROLLER_PORT overrides it (runtime contract)


class DemoHandlers:
    """The save and rename handlers, bound to this rank's live training state."""

    def __init__(self, rank: int, state: ShardState, ckpt_dir: Path, plan: FaultPlan, out: Path):
        self.rank, self.state, self.ckpt_dir, self.plan, self.out = rank, state, ckpt_dir, plan, out
        self.rename = DemoRename(rank, state, ckpt_dir)

    def save(self, step: int, save_ranks: list, ckpt_args: tuple) -> None:
        def midway() -> None:
            self.plan.check(self.rank, step, Phase.SAVE, self.out)

        entry = checkpoint.save_shard(self.ckpt_dir, step, self.rank, self.state, midway,
                                      _order_tag(step))
        # Like Megatron's save, the chosen ranks talk to each other over a gloo group built on
        # the save order's own store (never the job's: it dies with node 0): each learns that
        # every shard is on disk before it reports success.
        group = exchange.gloo_group(save_ranks, self.rank,
                                    f"{exchange.attempt_tag(step, save_ranks)}/demo/")
        mine = torch.tensor([float(self.state.shard), float(entry["bytes"])], dtype=torch.float64)
        parts = exchange.allgather(group, mine, len(save_ranks))
        shards = sorted(int(t[0]) for t in parts)
        if shards != list(range(self.state.layout.replica)):
            raise checkpoint.CheckpointError(f"saving ranks {sorted(save_ranks)} hold shards "
                                             f"{shards}, not one of each")
        print(
            f"rank {self.rank} | saved shard {self.state.shard} of step {step}: "
            f"{entry['bytes']} B in {1000 * float(entry['seconds']):.1f} ms "
            f"(saving ranks {sorted(save_ranks)}, {int(sum(float(t[1]) for t in parts))} B in "
            "all)",
            flush=True,
        )


class DemoRename:
    """The rename handler; ``checkpoint_location`` lets every rank's exit path name the
    directory in flow-finished.json (a bound method could not carry it)."""

    def __init__(self, rank: int, state: ShardState, ckpt_dir: Path) -> None:
        self.rank, self.state, self.ckpt_dir = rank, state, ckpt_dir

    def __call__(self, step: int, ckpt_args: tuple) -> None:
        final = checkpoint.finalize(self.ckpt_dir, step, self.state.layout, _order_tag(step))
        print(
            f"rank {self.rank} | checkpoint of step {step} renamed into place: {final}", flush=True
        )

    def checkpoint_location(self, step: int) -> Optional[str]:
        found = checkpoint.latest_dir(self.ckpt_dir, step)
        if found is None:  # not latest (a newer step is): the directory, when it is there
            here = self.ckpt_dir / checkpoint.step_dir_name(step)
            found = here.absolute() if here.is_dir() else None
        return None if found is None else str(found)

    def latest_iteration(self) -> Optional[int]:
        return checkpoint.latest_step_or_none(self.ckpt_dir)


def _order_tag(step: int) -> str:
    """The save order's tag: its own staging directory (no flow writes into another's)."""
    session = ttp.current_save_session()
    return session.tag if session is not None and session.step == step else ""


def _gather_full(layout: ShardLayout, state: ShardState, world: int) -> FullState:
    """Every shard's optimizer state, collected on all ranks (outside the update window)."""
    ms = [torch.empty(layout.shard_numel) for _ in range(world)]
    vs = [torch.empty(layout.shard_numel) for _ in range(world)]
    dist.all_gather(ms, state.exp_avg)
    dist.all_gather(vs, state.exp_avg_sq)
    keep = range(layout.replica)
    return FullState(
        state.step, state.params.detach().clone(), [ms[s] for s in keep], [vs[s] for s in keep]
    )


@ttp.ttp_to_persist
def train(args: argparse.Namespace, state: ShardState, handlers: DemoHandlers) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = state.layout
    out = Path(args.out)
    plan = handlers.plan
    # begin to init ttp processor & controller
    master_ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    dp_ranks = list(range(world))
    if rank == 0:
        ttp.ttp_init_controller(rank, world, len(dp_ranks) // 2, False)
        ttp.ttp_start_controller(master_ip, GUIDE_PORT)
    ttp.ttp_init_processor(rank, dp_ranks, len(dp_ranks), world, len(dp_ranks) // 2, False)
    ttp.ttp_start_processor(master_ip, GUIDE_PORT)
    ttp.ttp_register_save_ckpt_handler(handlers.save)
    ttp.ttp_register_rename_handler(handlers.rename)
    ttp.ttp_set_checkpoint_dir(handlers.ckpt_dir)  # faults are claimed there (one save per fault)

    snapshots = {}
    batches = _loader(args.loader_workers)
    for step in range(state.step + 1, args.steps + 1):
        if batches is not None:
            next(batches)  # the batch is not used: the loader's worker processes are the point
        if args.step_delay:
            time.sleep(args.step_delay)  # stands in for a longer step (preemption tests)
        loss, grad = forward_backward(state.params, step, rank)
        plan.check(rank, step, Phase.BEFORE, out)
        grads = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(grads, grad)  # summed in rank order below: bit-reproducible
        grad, norm = clip(reduce_grads(grads))

        def update(grad: torch.Tensor = grad, step: int = step) -> None:
            adam_update(state, grad, step)
            state.step = step

        # every collective of this update is done: should this rank leave the step before its
        # update (the barrier below failing for it), it may still run it (ttp_offer_update)
        ttp.ttp_offer_update(step, update)
        # all rank need to barrier (the guide's barrier after reduce_model_grads)
        dist.barrier()
        plan.check(rank, step, Phase.BARRIER, out)
        ttp.ttp_start_updating_os(-1)
        adam_update(state, grad, step)
        plan.check(rank, step, Phase.INSIDE, out)
        state.step = step
        ttp.ttp_end_updating_os(step)
        plan.check(rank, step, Phase.AFTER, out)
        mine = state.params.detach()[layout.bounds(state.shard)].contiguous()
        slices = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(slices, mine)
        with torch.no_grad():
            state.params.copy_(assemble(layout, slices))
        iteration = step
        ttp.ttp_set_ckpt_args((iteration, state))
        if rank == 0:
            print(f"rank 0 | step {step}/{args.steps} loss {loss:.6f} grad-norm {norm:.4f}",
                  flush=True)  # fmt: skip
        if args.snapshots:
            full = _gather_full(layout, state, world)
            if rank == 0:
                snapshots[step] = full.to_dict()

    final = _gather_full(layout, state, world)
    if rank == 0:
        torch.save(final.to_dict(), out / "final.pt")
        if args.snapshots:
            torch.save(snapshots, out / "snapshots.pt")
        print(f"rank 0 | finished step {final.step}: state sha256 {final.digest()[:16]}",
              flush=True)  # fmt: skip
    dist.barrier()


class _Endless(torch.utils.data.IterableDataset):
    def __iter__(self):
        i = 0
        while True:
            yield torch.tensor([i])
            i += 1


def _loader(workers: int):
    """Batches from a DataLoader with `workers` worker processes, as Megatron's default
    ``--num-workers 2`` has: a preemption signal that kills them must not cost the checkpoint
    (torch's SIGCHLD handler then raises in the training thread)."""
    if workers <= 0:
        return None
    loader = torch.utils.data.DataLoader(_Endless(), batch_size=None, num_workers=workers,
                                         persistent_workers=True)
    return iter(loader)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mindio_ttp.demo.job", description=__doc__)
    p.add_argument("--steps", type=int, required=True, help="train up to this optimizer step")
    p.add_argument("--ckpt-dir", required=True, help="dying checkpoints go here")
    p.add_argument("--out", required=True, help="final state, snapshots and fault records")
    p.add_argument("--faults", default="", help="fault plan, e.g. 1:5:sigkill:inside")
    p.add_argument("--resume", action="store_true", help="start from the latest checkpoint")
    p.add_argument("--snapshots", action="store_true", help="keep every step's state (rank 0)")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep this long per step")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="draw a batch per step from a DataLoader with this many workers")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    plan = FaultPlan.from_text(args.faults)
    torch.set_num_threads(1)
    RECOVERY.capability = recovery.capable  # this job can recover in memory (demo/recovery.py)
    ckpt_dir = Path(args.ckpt_dir)
    joined = recovery.replacement_order()
    if joined is not None:  # started by ttprun to replace a lost rank: join the recovery
        order, rank = joined
        layout = ShardLayout.for_world(int(os.environ["WORLD_SIZE"]))
        state = recovery.join_as_replacement(order, rank, layout)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        handlers = DemoHandlers(rank, state, ckpt_dir, plan, Path(args.out))
        recovery.run(lambda: train(args, state, handlers), state)
        dist.destroy_process_group()
        return 0
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ShardLayout.for_world(world)
    state = ShardState.fresh(layout, layout.shard_of(rank))
    if args.resume:
        loaded = checkpoint.load(ckpt_dir, layout)
        if loaded is None:
            print(f"rank {rank} | no checkpoint in {ckpt_dir}: nothing to resume", flush=True)
            return 2
        with torch.no_grad():
            state.params.copy_(loaded.state.params)
        state.exp_avg.copy_(loaded.state.exp_avg[state.shard])
        state.exp_avg_sq.copy_(loaded.state.exp_avg_sq[state.shard])
        state.step = loaded.state.step
        if rank == 0:
            print(f"rank 0 | resuming from {loaded.path} (step {state.step})", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    handlers = DemoHandlers(rank, state, ckpt_dir, plan, Path(args.out))
    recovery.run(lambda: train(args, state, handlers), state)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
