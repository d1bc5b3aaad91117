"""In-memory recovery for the demo job: what megatron_ttp/rejoin.py and refill.py do for
Megatron, for the toy's ZeRO-1 state, so ``ttp-demo`` shows the product's default mode.

A survivor leaves ``train`` on the controller's order (``TTPRecovering``), destroys its
process group, and joins the new world on the recovery's namespace of the authenticated store
(control/rank/authstore.py: reached over its TTP connection, nothing an outsider can write). A
replacement (started by ttprun with ``TTP_RECOVERY_JOIN``) first registers with the acting
controller, then joins the same world. The lost rank's replica partner (the other holder of
its shard) sends it the shard's Adam moments and the parameters of the recovery's step; then
every rank hashes what it holds (both holders of each shard, and every rank's parameters, must
agree: recovery/verify.py), reports ready, and trains on only once the controller commits.
Anything that fails on the way abandons the recovery: the controller then falls back to the
dying checkpoint of the same step, which the survivors still hold.
"""

from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from mindio_ttp import hooks
from mindio_ttp.demo.model import ShardLayout, ShardState, assemble
from mindio_ttp.hooks import TTPRecovering
from mindio_ttp.recovery.machine import RecoveryState as S
from mindio_ttp.recovery.rank import RECOVERY, RecoveryOrder, join_order, parse_address
from mindio_ttp.recovery.verify import check_digests

log = logging.getLogger("mindio_ttp.recovery")


def capable() -> Tuple[bool, str]:
    return True, ""


def run(train: Callable[[], None], state: ShardState) -> None:
    """Run `train`; after each in-memory recovery this rank survives, run it again."""
    while True:
        try:
            train()
            return
        except TTPRecovering:
            pass  # leave the except block: its traceback holds the old group's work
        try:
            _survivor_rejoins(state)
        except BaseException as exc:
            _failed(exc)
            raise


def replacement_order() -> Optional[Tuple[RecoveryOrder, int]]:
    return join_order()


def join_as_replacement(order: RecoveryOrder, rank: int, layout: ShardLayout) -> ShardState:
    """A replacement's start: register, join the new world, take the shard from its partner."""
    import mindio_ttp.framework_ttp as ttp

    RECOVERY.joining(order)
    try:
        world = int(os.environ["WORLD_SIZE"])
        dp = list(order.dp_ranks)
        ttp.ttp_init_processor(rank, dp, len(dp), world, len(dp) // 2, False)
        ttp.start_processor_at(*parse_address(order.controller))
        RECOVERY.machine.transition_to(S.REGROUPING, f"new world on {order.store}")
        _join_world(order, rank, world)
        state = ShardState.fresh(layout, layout.shard_of(rank))
        _refill_and_check(state, order)
    except BaseException as exc:
        _failed(exc)
        raise
    return state


def _survivor_rejoins(state: ShardState) -> None:
    order = RECOVERY.order
    assert order is not None and RECOVERY.machine.state is S.ORDERED, RECOVERY.machine.state
    RECOVERY.machine.transition_to(S.STOPPING, "left train()")
    if state.step != order.step:
        raise RuntimeError(f"this rank holds step {state.step}, not the recovery's "
                           f"{order.step}")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()  # on gloo: closes the old world's sockets
    RECOVERY.machine.transition_to(S.REGROUPING, f"new world on {order.store}")
    _join_world(order, rank, world)
    _refill_and_check(state, order)


def _join_world(order: RecoveryOrder, rank: int, world: int) -> None:
    from mindio_ttp.control.rank.authstore import AuthStore

    dist.init_process_group("gloo", store=AuthStore(order.store, timeout=order.deadline_s),
                            rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(60.0, order.deadline_s)))


def _refill_and_check(state: ShardState, order: RecoveryOrder) -> None:
    """The partner sends the lost rank its shard; every copy is hashed and compared; ready;
    the controller's commit; this rank then trains on from the recovery's step."""
    me, world = dist.get_rank(), dist.get_world_size()
    layout = state.layout
    lost = set(order.lost)
    RECOVERY.machine.transition_to(S.REFILLING, f"step {order.step}")
    holders = [r for r in range(world) if layout.shard_of(r) == state.shard]
    if me in lost:
        partner = next(r for r in holders if r not in lost)
        step = torch.zeros(1, dtype=torch.int64)
        for tensor in (step, state.exp_avg, state.exp_avg_sq, state.params.data):
            dist.recv(tensor, partner)
        state.step = int(step.item())
    else:
        for other in holders:
            if other in lost and min(r for r in holders if r not in lost) == me:
                dist.send(torch.tensor([state.step], dtype=torch.int64), other)
                for tensor in (state.exp_avg, state.exp_avg_sq, state.params.data):
                    dist.send(tensor.contiguous(), other)
    # the parameters of the step, the job's own way (the all-gather of every shard's slice
    # from its holders): a fault between the update and this all-gather left each survivor
    # with only its own slice of the step
    with torch.no_grad():
        slice_ = state.params.detach()[layout.bounds(state.shard)].contiguous()
        slices = [torch.empty_like(slice_) for _ in range(world)]
        dist.all_gather(slices, slice_)
        state.params.copy_(assemble(layout, slices))
    RECOVERY.machine.transition_to(S.VERIFYING)
    mine: Dict[str, Any] = {"rank": me, "dp_ranks": list(range(world)),
                            "stripes": {state.shard: _digest(state.exp_avg, state.exp_avg_sq)},
                            "replica": _digest(state.params.data),
                            "global": str(state.step)}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    problems = check_digests(everyone)
    if state.step != order.step:
        problems.append(f"rank {me} holds step {state.step}, not {order.step}")
    if problems:
        raise RuntimeError("the copies differ after the refill: " + "; ".join(problems))
    RECOVERY.machine.transition_to(S.READY)
    RECOVERY.report_ready(True, "", mine["replica"])
    ok, why = RECOVERY.wait_commit(order.deadline_s + 30.0)
    if not ok:
        raise RuntimeError(f"recovery {order.recovery_id} not committed: {why}")
    hooks.STATE.resume(order.step, (order.step, state))
    log.info("rank %d: in-memory recovery %d done: holds iteration %d, training goes on with "
             "iteration %d", me, order.recovery_id, order.step, order.step + 1)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _failed(exc: BaseException) -> None:
    """A step of the recovery failed here: the controller falls back to the dying checkpoint;
    this process then waits for its exit order like after any fault."""
    log.error("in-memory recovery failed on this rank: %r", exc)
    RECOVERY.report_ready(False, f"{type(exc).__name__}: {exc}")
    RECOVERY.abandon(f"failed here: {exc!r}"[:300])
    rt = hooks.RUNTIME
    if rt is not None and rt.running:
        try:
            hooks._wait_for_verdict(rt)
        except TTPRecovering:
            pass
