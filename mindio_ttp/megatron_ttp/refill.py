"""The patched loader during an in-memory recovery: refill, roll back, verify, commit.

Called by `mega.load_checkpoint` (edit 2.2) on every rank of the new world, in Megatron's
start-up, where a resume would read its checkpoint: nothing is read from disk. What each rank
does is what Megatron's `load_checkpoint` does with a checkpoint of the recovery's step t
(checkpointing.py:532-605: consumed samples, model, optimizer, scheduler, RNG), with the
state coming from memory:

* a replacement receives it from its replica partner, which holds both of its stripes (the
  partner's own is the replacement's partner stripe, and the other way round): the inner
  optimizers' state, the fp32 main params, the grad scaler, and from the partner's record of
  step t the scheduler's step count, the consumed samples and the RNG state. Megatron seeds by
  pipeline and tensor rank, never by data-parallel rank (initialize.py:_set_random_seed), so a
  data-parallel peer's RNG stream is the lost rank's;
* a survivor already holds its stripes at t (the controller chose t so); it rolls back what
  moved past t: RNG, scheduler and consumed samples, from its own record of t;
* every rank then rebuilds its model weights from the main params of t, Megatron's own way
  (main params into the param buffer, the param all-gather), which also repairs a survivor
  whose all-gather of t never finished.

Then every rank hashes what it holds; both holders of every stripe, and all data-parallel peers
(weights, RNG), must agree, or every rank refuses alike and the controller falls back to the
dying checkpoint. Training resumes only on the controller's commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron import get_args, get_timers, update_num_microbatches
from megatron.core import tensor_parallel
from megatron.optimizer.distrib_optimizer import DistributedOptimizer

from mindio_ttp import hooks
from mindio_ttp.megatron_ttp import log_record, rejoin, transfer
from mindio_ttp.recovery.machine import RecoveryState as S
from mindio_ttp.recovery.rank import RECOVERY, RecoveryRefused
from mindio_ttp.recovery.verify import check_digests

log = logging.getLogger("mindio_ttp.recovery")


class RecoveryMismatch(RecoveryRefused):
    """Two copies that must be equal after the refill are not."""


def load_in_memory(model, optimizer, scheduler) -> int:
    """Step t of the recovery in place of a checkpoint load; returns t (args.iteration)."""
    job = rejoin.current()
    assert job is not None
    order, args = job.order, get_args()
    step, lost = order.step, set(order.lost)
    me = dist.get_rank()
    RECOVERY.machine.transition_to(S.REFILLING, f"step {step}")
    if me in lost:
        _apply(transfer.recv_tree(optimizer.partner_rank, optimizer.pair_group), model,
               optimizer, scheduler, args)
    else:
        meta = optimizer.step_meta(step)
        if optimizer.partner_rank in lost:
            transfer.send_tree(_payload(optimizer, job.scheduler_state, meta, step), me,
                               optimizer.pair_group)
        _roll_back(meta, job.scheduler_state, scheduler, args)
    RECOVERY.machine.transition_to(S.VERIFYING)
    # The stripes first, before the weights are rebuilt: the param all-gather writes every
    # stripe's owner's values over the other copy (fp32 main params are views of the weights),
    # which would carry a bad refill into its holder, and the dying checkpoint (the fallback)
    # saves from the holders. Until the weights are checked, a fallback save rebuilds them.
    optimizer._gathered_step = -1
    stripes = verify_stripes(optimizer)
    _rebuild_weights(optimizer, args)
    logs = log_record.entry(step, me in lost, me == dist.get_world_size() - 1)
    digest, everyone = verify_replicas(model, optimizer, scheduler, step, stripes, logs)
    optimizer.record_loaded_step(step, scheduler)  # the weights are step's: checked
    RECOVERY.machine.transition_to(S.READY)
    RECOVERY.report_ready(True, "", digest)
    ok, why = RECOVERY.wait_commit(order.deadline_s + 30.0)
    if not ok:
        raise RecoveryRefused(f"recovery {order.recovery_id} not committed: {why}")
    hooks.STATE.resume(step, (step, model, optimizer, scheduler))
    rejoin.finished()
    if args.save and args.save_interval and step % args.save_interval == 0:
        # The fault may have cut Megatron's own periodic save of `step` short (the loop goes on
        # at step + 1 and would never write it): write it again, as the loop would have. If it
        # had finished, the same bytes are written over it.
        from megatron.checkpointing import save_checkpoint

        save_checkpoint(step, model, optimizer, scheduler)
    # the kept step's log line and scalars, when the fault took them (log_record.py)
    logged = log_record.decide(step, everyone, args.log_interval)
    if logged is not None:
        import megatron.training as training

        log_record.replay(training.training_log, logged, me == dist.get_world_size() - 1, model,
                        optimizer)
    log.info("rank %d: in-memory recovery %d done (%s): holds iteration %d, training goes on "
             "with iteration %d", me, order.recovery_id, job.role, step, step + 1)
    return step


# -- the replica partner's side -------------------------------------------------------------------
def _stripe_payload(stripe) -> dict:
    return {"optimizer": stripe.optimizer.state_dict(),
            "fp16_mains": stripe.shard_fp32_from_float16_groups,
            "fp32_mains": stripe.shard_fp32_groups}


def _payload(optimizer, scheduler_state: dict, meta: dict, step: int) -> dict:
    """Everything the partner's replacement needs of step `step`, as references."""
    return {
        "step": step,
        "stripes": {s.position: _stripe_payload(s) for s in optimizer.stripes()},
        "grad_scaler": optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None,
        "scheduler": {**scheduler_state, "num_steps": meta["scheduler_num_steps"]},
        "rng_state": meta["rng_state"],
        "consumed_train_samples": meta["consumed_train_samples"],
        "consumed_valid_samples": meta["consumed_valid_samples"],
    }


# -- the replacement's side -----------------------------------------------------------------------
def _apply(payload: dict, model, optimizer, scheduler, args) -> None:
    args.consumed_train_samples = payload["consumed_train_samples"]
    update_num_microbatches(consumed_samples=args.consumed_train_samples)
    args.consumed_valid_samples = payload["consumed_valid_samples"]
    for stripe in optimizer.stripes():
        got = payload["stripes"][stripe.position]
        stripe.optimizer.load_state_dict(got["optimizer"])
        for mine, theirs in ((stripe.shard_fp32_from_float16_groups, got["fp16_mains"]),
                             (stripe.shard_fp32_groups, got["fp32_mains"])):
            for group, saved in zip(mine, theirs):
                for current, value in zip(group, saved):
                    current.data.copy_(value)
    if optimizer.grad_scaler and payload["grad_scaler"] is not None:
        optimizer.grad_scaler.load_state_dict(payload["grad_scaler"])
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng_state"])


# -- a survivor's side ----------------------------------------------------------------------------
def _roll_back(meta: dict, scheduler_state: dict, scheduler, args) -> None:
    args.consumed_train_samples = meta["consumed_train_samples"]
    update_num_microbatches(consumed_samples=args.consumed_train_samples)
    args.consumed_valid_samples = meta["consumed_valid_samples"]
    scheduler.load_state_dict({**scheduler_state, "num_steps": meta["scheduler_num_steps"]})
    set_rng_state(meta["rng_state"])


def set_rng_state(state: dict) -> None:
    """Megatron's own restore (checkpointing.py:587-596)."""
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rebuild_weights(optimizer, args) -> None:
    """Both stripes' main params into the param buffer, then Megatron's param all-gather over
    the (new) data-parallel group: every weight of step t on every rank."""
    optimizer._copy_main_params_to_model_params()
    DistributedOptimizer.gather_model_params(optimizer, args, get_timers())


# -- verification ---------------------------------------------------------------------------------
def _hash_tensors(h, tensors) -> None:
    for t in tensors:
        data = t.detach().reshape(-1).contiguous().cpu()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(data.view(torch.uint8).numpy().tobytes())


def _leaves(tree: Any) -> List[Any]:
    if isinstance(tree, dict):
        return [x for k in sorted(tree, key=str) for x in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


def _digest(tree: Any) -> str:
    h = hashlib.sha256()
    for leaf in _leaves(tree):
        if torch.is_tensor(leaf):
            _hash_tensors(h, [leaf])
        elif isinstance(leaf, np.ndarray):
            h.update(leaf.tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def _stripe_digest(stripe, grad_scaler) -> str:
    state = stripe.optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    return _digest([state["state"], groups, stripe.shard_fp32_from_float16_groups,
                    stripe.shard_fp32_groups,
                    grad_scaler.state_dict() if grad_scaler else None])


def _agree(mine: Dict[str, Any], what: str) -> List[Dict[str, Any]]:
    """Everyone's digests (one all-gather on the new world); raises RecoveryMismatch, alike on
    every rank, when two copies that must be equal are not."""
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = check_digests(everyone)
    if problems:
        raise RecoveryMismatch(f"{what} differ after the refill: " + "; ".join(problems[:8]))
    return everyone


def verify_stripes(optimizer) -> Dict[int, str]:
    """Both holders of every optimizer stripe hold the same bytes (state, main params)."""
    stripes = {s.position: _stripe_digest(s, optimizer.grad_scaler) for s in optimizer.stripes()}
    _agree({"rank": dist.get_rank(), "dp_ranks": tuple(optimizer.dp_ranks), "stripes": stripes},
           "optimizer stripes")
    return stripes


def verify_replicas(model, optimizer, scheduler, step: int, stripes: Dict[int, str],
                    logs: Optional[Dict[str, Any]] = None) -> Tuple[str, List[Dict[str, Any]]]:
    """Data-parallel peers hold the same weights and RNG state, every rank the same step,
    consumed samples and scheduler count. Returns this rank's summary digest and everyone's
    entries, which also carry each rank's record of the step's logging (`logs`, log_record.py:
    the same gather, so every rank decides alike whether to log the step again)."""
    from mindio_ttp.megatron_ttp.step_record import local_rng_state

    args = get_args()
    mine = {
        "rank": dist.get_rank(),
        "dp_ranks": tuple(optimizer.dp_ranks),
        "replica": _digest([_model_tensors(model), local_rng_state()]),
        "global": json.dumps([step, args.consumed_train_samples, args.consumed_valid_samples,
                              scheduler.num_steps]),
    }
    everyone = _agree({**mine, "step_log": logs}, "weights, RNG or counters")
    return hashlib.sha256(json.dumps({**mine, "stripes": stripes}, sort_keys=True,
                                     default=str).encode()).hexdigest(), everyone


def _model_tensors(model) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for chunk in model:
        sd = chunk.state_dict_for_save_checkpoint()
        out += [t for t in _leaves(sd) if torch.is_tensor(t)]
    return out
