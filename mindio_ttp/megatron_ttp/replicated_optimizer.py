"""`ReplicatedOptimizer`: Megatron's distributed optimizer with every state shard on two ranks.

Layout (striped). With d DP positions and s = d/2, DP position p keeps two *stripes*: its own
stock stripe p (exactly the range Megatron's `DistributedOptimizer` gives position p, built by
the stock code) and its partner's stripe p' (p' = (p + s) mod d, or, when those pairs would
share a host, any pairing that puts partners on different hosts: pairing.py). So shard k (the
TTP runtime's unit: the two positions of pair k hold the same shard) is the pair of stock
stripes {p, p'}, and each position holds, in its own memory, the exact state stock Megatron
keeps at position p *and* at its partner. That is what makes checkpoints local:

- `state_dict()` returns the own stripe's stock state (references, like stock): no collective,
  no copy; stock Megatron loads it and we load stock files.
- `load_state_dict()` loads the own file into the own stripe and the partner's stock file
  (read from the checkpoint directory `load.py` names) into the partner stripe; without a
  directory, one exchange with the partner over the pair's own group.
- The dying checkpoint writes each chosen rank's own file, and the partner's file from the
  partner stripe when the partner is not saving (dead): no exchange of optimizer state.

Per-step communication, on Megatron's groups and the job's backend only (NCCL, HCCL or gloo:
no explicit backend anywhere here): stock reduce-scatter of grads over the DP group, then each
rank swaps its reduced stripe with its partner (`batch_isend_irecv` on a 2-rank group per pair,
created once at start-up with the default backend), then the stock param all-gather of own
stripes. Bytes per rank per step (fp32): stock's 2(d-1)/d N plus N/d, i.e. 1 + 1/(2(d-1))
times stock; with bf16 params and fp32 grads, 1 + 2/(3(d-1)) (bench/bench_optimizer.py).

The TTP contract forbids collectives between `ttp_start_updating_os` and `ttp_end_updating_os`:
a rank killed there must not leave survivors blocked half-updated. So every collective of the
update (reduce-scatter, partner swap, inf check, grad norm, zero count) runs in
`reduce_model_grads`, whose results `step` only reads; the param all-gather stays in
`gather_model_params`, after the window. Norm and zero count use only the own stripe (the stock
code does exactly that), so every element counts once over the DP group; the inf check covers
both stripes and is a MAX over the world, so both partners agree. Each rank updates both its
stripes with the same grads, clip factor and hyperparameters, so the two copies of a stripe stay
bit-identical (the optimizer update is elementwise).
"""

from __future__ import annotations

import inspect
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from megatron import print_rank_0
from megatron.core import mpu
from megatron.optimizer.distrib_optimizer import DistributedOptimizer, Range
from megatron.optimizer.optimizer import _zero_grad_group_helper

from mindio_ttp import config as ttp_config
from mindio_ttp import framework_ttp
from mindio_ttp.faulttime import device_copy
from mindio_ttp.faulttime.manifest import ParallelLayout
from mindio_ttp.megatron_ttp import pairing
from mindio_ttp.megatron_ttp.step_record import StepRecord

REPLICAS = 2  # the striped layout keeps every stripe on exactly two ranks

# set by load.py around Megatron's loader: (iteration directory, tp rank, pp rank, layout)
_load_source: Optional[Tuple[Path, Any]] = None


@contextmanager
def loading_from(iter_dir: Optional[Path], optim_file) -> Iterator[None]:
    """While Megatron loads `iter_dir`, `load_state_dict` reads the partner's stock file from
    there (`optim_file(position) -> relative path`) instead of exchanging it."""
    global _load_source
    previous = _load_source
    _load_source = (iter_dir, optim_file) if iter_dir is not None else None
    try:
        yield
    finally:
        _load_source = previous


@dataclass(frozen=True)
class Place:
    """This rank's global, tensor- and pipeline-parallel rank and the job's layout."""

    rank: int
    tp_rank: int
    pp_rank: int
    layout: ParallelLayout


@dataclass
class Stripe:
    """What stock DistributedOptimizer builds for one DP position, for a position of our
    choice: ranges into the grad buffers, the model/main param groups, the inner optimizer."""

    position: int
    gbuf_ranges: list
    param_gbuf_map: dict
    opt_group_ranges: list
    model_float16_groups: list
    model_fp32_groups: list
    shard_float16_groups: list
    shard_fp32_groups: list
    shard_fp32_from_float16_groups: list
    optimizer: Any

    def param_range(self, model_param, key: str) -> Range:
        model_index, dtype = self.param_gbuf_map[model_param]
        return self.gbuf_ranges[model_index][dtype]["param_map"][model_param][key]

    def main_params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def main_of(self) -> Dict[int, torch.Tensor]:
        """id(model param) -> the fp32 main shard this stripe updates for it."""
        out = {}
        for models, mains in ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                              (self.model_fp32_groups, self.shard_fp32_groups)):
            for model_group, main_group in zip(models, mains):
                for model_param, main in zip(model_group, main_group):
                    out[id(model_param)] = main
        return out

    def copy_model_grads_to_main_grads(self) -> None:
        """Stock `_copy_model_grads_to_main_grads` for this stripe's ranges."""
        for models, mains in ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                              (self.model_fp32_groups, self.shard_fp32_groups)):
            for model_group, main_group in zip(models, mains):
                for model_param, main in zip(model_group, main_group):
                    r = self.param_range(model_param, "param")
                    main.grad = model_param.main_grad.view(-1)[r.start:r.end].float()

    def copy_main_params_to_param_buffer(self, param_buffers) -> None:
        """Stock `_copy_main_params_to_model_params` for this stripe's ranges."""
        for mains, models in ((self.shard_fp32_from_float16_groups, self.model_float16_groups),
                              (self.shard_fp32_groups, self.model_fp32_groups)):
            for main_group, model_group in zip(mains, models):
                for main, model_param in zip(main_group, model_group):
                    r = self.param_range(model_param, "gbuf_world")
                    model_id, dtype = self.param_gbuf_map[model_param]
                    param_buffers[model_id][dtype].view(-1)[r.start:r.end].data.copy_(main)

    def zero_grad(self, set_to_none: bool) -> None:
        for groups in (self.shard_float16_groups, self.shard_fp32_groups,
                       self.shard_fp32_from_float16_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def state_dict(self, grad_scaler) -> dict:
        """Stock DistributedOptimizer.state_dict() of this position: references, no copy."""
        sd = {"optimizer": self.optimizer.state_dict()}
        if grad_scaler:
            sd["grad_scaler"] = grad_scaler.state_dict()
        sd["shard_fp32_from_float16_groups"] = self.shard_fp32_from_float16_groups
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Stock DistributedOptimizer.load_state_dict() for this stripe (grad scaler aside)."""
        self.optimizer.load_state_dict(sd["optimizer"])
        for current_group, saved_group in zip(self.shard_fp32_from_float16_groups,
                                              sd["shard_fp32_from_float16_groups"]):
            for current, saved in zip(current_group, saved_group):
                current.data.copy_(saved.data)


def stock_gbuf_range(model, dtype, position: int, dp: int) -> dict:
    """DistributedOptimizer.build_model_gbuf_range for DP `position` (stock reads its own)."""
    gbuf_size = model._grad_buffers[dtype].numel
    size = -(-gbuf_size // dp)
    world_all = [Range(min(gbuf_size, r * size), min(gbuf_size, r * size + size))
                 for r in range(dp)]
    world = world_all[position]
    return {
        "local": world.normalize(),
        "world": world,
        "world_all": world_all,
        "param_map": DistributedOptimizer.build_model_gbuf_param_range_map(model, dtype, world),
        "max_range_size": size,
    }


class ReplicatedOptimizer(StepRecord, DistributedOptimizer):
    """Drop-in for `DistributedOptimizer` (same constructor) that keeps each stripe twice.

    During a survivor's in-memory recovery (rejoin.py) Megatron's start-up builds the optimizer
    again: the constructor then gives back the survivor's own optimizer, whose state is the
    recovery's, with only its pair groups made anew on the new world."""

    _reused = False  # set on an instance __new__ hands back during a recovery

    def __new__(cls, *args, **kwargs):
        from mindio_ttp.megatron_ttp.rejoin import kept_optimizer

        kept = kept_optimizer()
        if kept is not None:
            kept._reused = True
            return kept
        return super().__new__(cls)

    def __init__(self, optimizer, clip_grad, log_num_zeros_in_grad, params_have_main_grad,
                 use_contiguous_buffers_in_local_ddp, fp16, bf16, params_dtype, grad_scaler,
                 models, replica_count: Optional[int] = None):
        if self._reused:  # the survivor's own optimizer: only the groups are new
            self._reused = False
            # the replacement's constructor makes the pairing's collective: meet it, and hand
            # it the pairs the held stripes are laid out by
            self.pairings = self._choose_pairings(kept=self.pairings)
            self.pair_group = self._build_pair_groups()
            return
        dp = mpu.get_data_parallel_world_size()
        replica_count = REPLICAS if replica_count is None else replica_count
        if replica_count != REPLICAS or dp % REPLICAS:
            raise ValueError(
                f"ReplicatedOptimizer keeps every optimizer stripe on exactly {REPLICAS} DP ranks "
                f"(asked for {replica_count}); the data-parallel size ({dp}) must be even: "
                f"choose an even DP size (>= 2)"
            )
        self.replica_count = REPLICAS
        self.num_shards = dp // REPLICAS
        self.dp_size = dp
        # where this rank sits, kept for the dying checkpoint: after a survivor left the world
        # for an in-memory recovery that then fails, torch.distributed and mpu know nothing
        self.place = Place(torch.distributed.get_rank(), mpu.get_tensor_model_parallel_rank(),
                           mpu.get_pipeline_model_parallel_rank(),
                           ParallelLayout(mpu.get_tensor_model_parallel_world_size(),
                                          mpu.get_pipeline_model_parallel_world_size(), dp))
        self.dp_position = mpu.get_data_parallel_rank()
        self.dp_ranks: List[int] = list(
            torch.distributed.get_process_group_ranks(mpu.get_data_parallel_group())
        )
        # partners on different hosts (pairing.py): every DP group's pairs, from every host
        self.pairings = self._choose_pairings()
        self.pairs = self.pairings[tuple(self.dp_ranks)]
        self._partner_of = pairing.partner_map(self.pairs)
        self.partner_position = self._partner_of[self.dp_position]
        self.shard_index = next(k for k, pair in enumerate(self.pairs)
                                if self.dp_position in pair)
        self.replica_index = self.pairs[self.shard_index].index(self.dp_position)
        self.partner_rank = self.dp_ranks[self.partner_position]
        # One source for the layout: the runtime refuses a `replica` that disagrees, and
        # counts shards in this order (pair k at DP places k and k + DP/2).
        framework_ttp.declare_optimizer_shards(
            self.num_shards, pairing.runtime_order(self.dp_ranks, self.pairs))
        # the stock constructor rewrites the groups' params in place: keep the originals
        orig_groups = [dict(g) for g in optimizer.param_groups]
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, params_have_main_grad,
                         use_contiguous_buffers_in_local_ddp, fp16, bf16, params_dtype,
                         grad_scaler, models)
        self.own = Stripe(self.dp_position, self.model_gbuf_ranges, self.model_param_gbuf_map,
                          self.opt_group_ranges, self.model_float16_groups,
                          self.model_fp32_groups, self.shard_float16_groups,
                          self.shard_fp32_groups, self.shard_fp32_from_float16_groups,
                          self.optimizer)
        self.partner = self._build_stripe(self.partner_position, orig_groups)
        self.pair_group = self._build_pair_groups()
        self._pending: Optional[Tuple[bool, Optional[float], Optional[float]]] = None
        self._init_step_record()

    # ---- layout -------------------------------------------------------------------------

    def _choose_pairings(self, kept: Optional[Dict[Tuple[int, ...], List[pairing.Pair]]] = None
                         ) -> Dict[Tuple[int, ...], List[pairing.Pair]]:
        """The pairs of every DP group, from every rank's DP group and host name (one
        all_gather_object on the default group, at start-up); the same on every rank. Warns
        (or, with TTP_REQUIRE_CROSS_HOST_REPLICAS=1, refuses) when some pair must share a
        host (a host holds more than half of a DP group).

        After an in-memory recovery the survivors pass the pairs they hold (`kept`): their
        stripes are laid out by them, so every rank, the replacements included, takes those,
        whatever host a replacement landed on (a pair that now shares a host is warned of)."""
        world = torch.distributed.get_world_size()
        everyone: List[Optional[tuple]] = [None] * world
        torch.distributed.all_gather_object(everyone, (self.dp_ranks, _hostname(), kept))
        hosts = {r: h for r, (_, h, _) in enumerate(everyone)}  # type: ignore[misc]
        held = [k for _, _, k in everyone if k is not None]  # type: ignore[misc]
        if held:
            if any(k != held[0] for k in held):
                raise RuntimeError("the surviving ranks hold different optimizer pairings: "
                                   "their stripes cannot be matched")
            pairings = held[0]
        else:
            groups = sorted({tuple(d) for d, _, _ in everyone})  # type: ignore[misc]
            pairings = {g: pairing.choose_pairs([hosts[r] for r in g]) for g in groups}
        check_partner_hosts(pairings, hosts)
        return pairings

    def _build_stripe(self, position: int, orig_groups: List[dict]) -> Stripe:
        """The partner's stripe, built by the stock class methods, with its own inner
        optimizer: a new instance of our optimizer's class with the same options
        (`fresh_like`), never a copy: torch's Optimizer.__getstate__ keeps only defaults,
        state and groups, so a copy loses what the constructor set (apex FusedAdam's
        `adam_w_mode`), and fused optimizers keep per-instance buffers (torch_npu's
        NpuFusedOptimizerBase fills lists made in __init__ with combined param and grad
        buffers) that the two stripes must not share."""
        ranges = [{dtype: stock_gbuf_range(model, dtype, position, self.dp_size)
                   for dtype in model._grad_buffers} for model in self.models]
        pmap = self.build_model_param_gbuf_map(ranges)
        groups = [dict(g) for g in orig_groups]
        opt_ranges = self.build_optimizer_group_ranges(groups, ranges)
        built = self.build_model_and_main_param_groups(ranges, pmap, opt_ranges)
        inner = fresh_like(self.optimizer, [g["orig_group"] for g in opt_ranges])
        return Stripe(position, ranges, pmap, opt_ranges, *built, inner)

    def _build_pair_groups(self):
        """One 2-rank group per pair of partners, on the job's default backend (NCCL, HCCL,
        gloo); every rank creates every group, in the same order."""
        mine = None
        for ranks, pairs in sorted(self.pairings.items()):
            for a, b in pairs:
                pair = sorted([ranks[a], ranks[b]])
                group = torch.distributed.new_group(pair)
                if torch.distributed.get_rank() in pair:
                    mine = group
        return mine

    def partner_of(self, position: int) -> int:
        """The DP position that holds the same shard as `position`, in my DP group."""
        return self._partner_of[position]

    def stripes(self) -> Tuple[Stripe, Stripe]:
        return self.own, self.partner

    # ---- Megatron optimizer API ---------------------------------------------------------

    def _get_param_groups(self):
        """Both stripes' groups: Megatron's scheduler sets lr and weight decay through this,
        so the partner stripe is updated with the same hyperparameters as its owner."""
        return self.own.optimizer.param_groups + self.partner.optimizer.param_groups

    param_groups = property(_get_param_groups, DistributedOptimizer._set_param_groups)

    def _collect_main_grad_data_for_unscaling(self):
        return [p.grad.data for stripe in self.stripes() for p in stripe.main_params()]

    def _copy_model_grads_to_main_grads(self):
        for stripe in self.stripes():
            stripe.copy_model_grads_to_main_grads()

    def _copy_main_params_to_model_params(self):
        for stripe in self.stripes():
            stripe.copy_main_params_to_param_buffer(self.param_buffers)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self.partner.zero_grad(set_to_none)

    def clip_grad_norm(self, clip_grad, total_norm: Optional[float] = None):
        """The norm over the own stripe only (stock: each element once over the DP group);
        the clip factor applied to both stripes. With `total_norm` (from `_grad_norm`, taken
        while the swap was in flight) no collective runs here: only stock's clip, with stock's
        coefficient, applied to both stripes in one call on every rank alike."""
        from megatron.optimizer import clip_grads

        params = self.own.main_params() + self.partner.main_params()
        if total_norm is None:
            return clip_grads.clip_grad_norm_fp32(
                params, self.get_main_grads_for_grad_norm(), clip_grad,
                model_parallel_group=self.get_model_parallel_group())
        clip_coeff = float(clip_grad) / (total_norm + 1.0e-6)  # stock's, clip_grads.py:101
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if clip_coeff < 1.0 and grads:
            # stock's multi_tensor_scale is one fp32 multiply per element, as this is; apex's
            # amp_C is not on every stack (Ascend), torch's foreach ops are
            torch._foreach_mul_(grads, clip_coeff)
        return total_norm

    def _grad_norm(self) -> float:
        """Stock's gradient norm over the own stripe (its all-reduce over the world), without
        the clip: it only reads the grads, so it may run while the swap sends them."""
        from megatron.optimizer.clip_grads import clip_grad_norm_fp32

        # max_norm inf: the coefficient is never < 1, so clip_grad_norm_fp32 writes nothing
        return clip_grad_norm_fp32([], self.get_main_grads_for_grad_norm(), float("inf"),
                                   model_parallel_group=self.get_model_parallel_group())

    def grad_buffer_views(self) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(whole grad buffer, own stock view, partner's stock view) per buffer."""
        out = []
        for _mi, _dtype, gbuf, views in self.get_model_grad_buffer_dp_views():
            out.append((gbuf, views[self.dp_position], views[self.partner_position]))
        return out

    def reduce_model_grads(self, args, timers):
        """All collectives of the update: stock reduce-scatter, partner swap, inf check, norm,
        zero count. The swap (pair group) runs beside the norm's all-reduce (the world): both
        are latency more than bytes on most steps, and the norm only reads the grads. What
        writes them (the unscale, the clip) waits for the swap: in fp32 and bf16 the own main
        grads are views of the very buffer being sent."""
        DistributedOptimizer.reduce_model_grads(self, args, timers)
        timers('grads-partner-swap', log_level=1).start(barrier=args.barrier_with_L1_time)
        swap = self._start_swap([(own, theirs) for _, own, theirs in self.grad_buffer_views()])
        self.own.copy_model_grads_to_main_grads()  # views or fresh copies: writes no buffer
        total_norm = None
        if not self.grad_scaler and self.clip_grad > 0.0:
            total_norm = self._grad_norm()
        self._finish_swap(swap)
        timers('grads-partner-swap').stop()

        self.partner.copy_model_grads_to_main_grads()
        found_inf = False
        if self.grad_scaler:
            found_inf = self._unscale_main_grads_and_check_for_nan()
        grad_norm = num_zeros = None
        if not found_inf:
            if self.clip_grad > 0.0:
                grad_norm = self.clip_grad_norm(self.clip_grad, total_norm)
            if self.log_num_zeros_in_grad:
                num_zeros = self.count_zeros()
        self._pending = (found_inf, grad_norm, num_zeros)
        # Every collective of this update is done. Should this rank leave the step before its
        # update (the guide's barrier, next, fails for it while its partners pass it), the
        # runtime may still run the update while the rank waits for the verdict.
        framework_ttp.ttp_offer_update(self.current_step + 1, self._catch_up)

    def _start_swap(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> list:
        """The swap's sends and receives, in one batch on the pair's group (device tensors:
        the buffers themselves, nothing staged); its works, for `_finish_swap`. Until then
        nothing may write an `own` view or read a `theirs` one."""
        if self.partner_position == self.dp_position:
            return []
        dist = torch.distributed
        ops = []
        for own, theirs in pairs:
            ops.append(dist.P2POp(dist.isend, own, self.partner_rank, group=self.pair_group))
            ops.append(dist.P2POp(dist.irecv, theirs, self.partner_rank, group=self.pair_group))
        return dist.batch_isend_irecv(ops)

    def _finish_swap(self, works: list) -> None:
        for req in works:
            req.wait()  # NCCL/HCCL: the current stream waits; gloo: the host

    def _catch_up(self) -> None:
        """What the patched train_step runs between ttp_start/end_updating_os: step() and
        increase_step() (the record of the step: consumed samples, scheduler count, RNG)."""
        from megatron import get_args

        self.step(get_args(), None)  # purely local; the timers are not used
        self.increase_step()

    @torch.no_grad()
    def step(self, args, timers):
        """Purely local: uses what reduce_model_grads computed; updates both stripes, and only
        then writes both into the param buffers (they share memory with the grad buffers)."""
        if self._pending is None:
            raise RuntimeError("ReplicatedOptimizer.step() needs reduce_model_grads() first "
                               "(it runs the collectives of the update)")
        found_inf, grad_norm, num_zeros = self._pending
        self._pending = None
        self._last_found_inf = found_inf
        if self.grad_scaler:
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.last_update = (False, None, None)
                return self.last_update
        self.own.optimizer.step()
        self.partner.optimizer.step()
        # Both stripes go into the param buffer, not only the own one as stock does, although
        # the all-gather that follows fills the partner's range with the same bits: fp32 main
        # params are views of the model params (stock), and gather_model_params' copies from
        # the buffer into the params are queued behind the all-gather. When a peer dies inside
        # it, the abort lets those copies run on whatever the buffer holds; had the partner's
        # range been left to the all-gather, it would hold this step's grads (the buffer shares
        # memory with the grad buffer) or a torn receive, and the copies would overwrite the
        # partner stripe's main params with it: the state a dying checkpoint or a refill reads
        # (tests/megatron/test_save_hazards.py, params still gathering). Written here, a torn
        # receive only writes the same bits again.
        self._copy_main_params_to_model_params()
        # what the step's log line prints, should train_step fail after it (log_record.py)
        self.last_update = (True, grad_norm, num_zeros)
        return self.last_update

    def gather_model_params(self, args, timers):
        """Stock's all-gather of the own stripes over the DP group and its copies into the
        params, then the device event that says they are done (`device_copy.GATHERED`): on
        NCCL/HCCL the host returns as soon as the all-gather is enqueued, so only the device
        can say whether the live params hold this step (a dying checkpoint reads them only
        then)."""
        timers('params-all-gather', log_level=1).start(barrier=args.barrier_with_L1_time)
        position, group = mpu.get_data_parallel_rank(), mpu.get_data_parallel_group()
        works = [torch.distributed._all_gather_base(pbuf, views[position], group=group,
                                                    async_op=True)
                 for _model, _dtype, pbuf, views in self.get_model_param_buffer_dp_views()]
        for work in works:
            work.wait()  # as the stock call: the current stream waits (NCCL), the host (gloo)
        for model_id, model in enumerate(self.models):
            for dtype, param_map in model._grad_buffer_param_index_map.items():
                param_buf = self.param_buffers[model_id][dtype]
                for param, (start, end) in param_map.items():
                    param.view(-1).detach().copy_(param_buf[start:end])
        device_copy.GATHERED.record(self.current_step, works)
        timers('params-all-gather').stop()

    def record_loaded_step(self, iteration: int, scheduler) -> None:
        super().record_loaded_step(iteration, scheduler)
        device_copy.GATHERED.record(iteration)  # the loaded model weights are that step's

    # ---- checkpoints --------------------------------------------------------------------

    def state_dict(self):
        """Stock DistributedOptimizer.state_dict() of this DP position, from the own stripe:
        no collective, no copy."""
        return self.own.state_dict(self.grad_scaler)

    def stripe_state_dict(self, position: int) -> dict:
        """The stock optimizer state of DP `position`, which must be this rank's or its
        partner's (the dying checkpoint writes the partner's file when the partner is dead)."""
        for stripe in self.stripes():
            if stripe.position == position:
                return stripe.state_dict(self.grad_scaler)
        raise ValueError(f"DP position {self.dp_position} holds stripes {self.dp_position} and "
                         f"{self.partner_position}, not {position}")

    def load_state_dict(self, state_dict):
        """This position's stock file into the own stripe (stock code), the partner's stock
        file into the partner stripe: read from the checkpoint directory when load.py names
        it, else one exchange with the partner over the pair's group."""
        DistributedOptimizer.load_state_dict(self, state_dict)
        self.partner.load_state_dict(self._partner_state(state_dict))

    def _partner_state(self, mine: dict) -> dict:
        if self.partner_position == self.dp_position:
            return mine
        if _load_source is not None:
            iter_dir, optim_file = _load_source
            path = Path(iter_dir) / optim_file(self.partner_position)
            return torch.load(path, map_location="cpu", weights_only=True)["optimizer"]
        both: List[Optional[dict]] = [None, None]
        torch.distributed.all_gather_object(both, mine, group=self.pair_group)
        ranks = sorted([torch.distributed.get_rank(), self.partner_rank])
        return both[ranks.index(self.partner_rank)]  # type: ignore[return-value]

    def save_plan(self, save_ranks: Sequence[int]) -> Tuple[List[int], bool]:
        """What this chosen rank writes in a dying checkpoint: its own stock file, the
        partner's too when the partner is not saving, and whether it writes the model file
        (the chosen rank of the DP group with the lowest DP position)."""
        chosen = {self.dp_ranks.index(r) for r in save_ranks if r in self.dp_ranks}
        for k, (a, b) in enumerate(self.pairs):
            if not chosen & {a, b}:
                raise RuntimeError(
                    f"save ranks {sorted(save_ranks)} hold no copy of shard {k} of DP group "
                    f"{self.dp_ranks} (positions {a} and {b})")
        if self.dp_position not in chosen:
            raise RuntimeError(f"rank {self.place.rank} is not among the save "
                               f"ranks {sorted(save_ranks)}")
        positions = [self.dp_position]
        if self.partner_position not in chosen:
            positions.append(self.partner_position)
        return sorted(positions), min(chosen) == self.dp_position

    # ---- TTP hooks (see StepRecord) ---------------------------------------------------

    def memory_report(self) -> str:
        """Measured optimizer-state bytes on this rank, and what DistributedOptimizer would hold
        for the same grad buffers (its own stripe only)."""
        owned = sum(p.numel() for s in self.stripes() for p in s.main_params())
        stock_owned = sum(p.numel() for p in self.own.main_params())
        state_bytes = 0
        for stripe in self.stripes():
            for p in stripe.main_params():
                state_bytes += sum(v.numel() * v.element_size()
                                   for v in stripe.optimizer.state.get(p, {}).values()
                                   if torch.is_tensor(v) and v.dim() > 0)
            state_bytes += sum(m.numel() * m.element_size()
                               for g in stripe.shard_fp32_from_float16_groups for m in g)
        total = sum(gbuf.numel for model in self.models for gbuf in model._grad_buffers.values())
        per_elem = state_bytes / owned if owned else 0.0
        return (f"mindio_ttp: ReplicatedOptimizer rank {torch.distributed.get_rank()} "
                f"(DP position {self.dp_position}, stripes {self.dp_position} and "
                f"{self.partner_position}, shard {self.shard_index} of {self.num_shards}, "
                f"replica {self.replica_index}): {owned} of {total} params, "
                f"optimizer state {state_bytes} B = {state_bytes / total:.3f} B/param; "
                f"DistributedOptimizer would hold {stock_owned} params = "
                f"{per_elem * stock_owned / total:.3f} B/param")


def _hostname() -> str:
    """This rank's host name, as the partner check compares them."""
    return socket.gethostname()


def fresh_like(optimizer: torch.optim.Optimizer, param_groups: List[dict]):
    """A new optimizer of `optimizer`'s class over `param_groups`, built with the same
    constructor options: each constructor argument is taken from the optimizer's `defaults`
    (where torch.optim keeps them), else from an attribute of that name (apex FusedAdam keeps
    `adam_w_mode` and `set_grad_none` there), else its constructor default.

    The constructor gets one empty placeholder per group, and the groups are then set the
    way stock DistributedOptimizer sets its own optimizer's: their params are views into the
    model's params (fp32) or main params, which a constructor refuses ("can't optimize a
    non-leaf Tensor")."""
    cls = type(optimizer)
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, params
    kwargs: Dict[str, Any] = {}
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if p.name in optimizer.defaults:
            kwargs[p.name] = optimizer.defaults[p.name]
        elif hasattr(optimizer, p.name):
            kwargs[p.name] = getattr(optimizer, p.name)
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"cannot build a second {cls.__name__} for the partner stripe: its "
                            f"constructor argument {p.name!r} is neither in its defaults nor an "
                            "attribute")
    device = next((p.device for g in param_groups for p in g["params"]), None)
    inner = cls([{**g, "params": [torch.empty(0, device=device)]} for g in param_groups],
                **kwargs)
    inner.param_groups = param_groups
    return inner


def check_partner_hosts(pairings: Dict[Tuple[int, ...], List[pairing.Pair]],
                        hosts: Dict[int, str]) -> None:
    """Say when partners had to leave the natural p + DP/2 pairing to sit on two hosts, and
    warn (or refuse, with TTP_REQUIRE_CROSS_HOST_REPLICAS=1) when some shard has both copies
    on one host anyway: a host holds more than half of a DP group, so no pairing can avoid it,
    and losing that host loses the shard."""
    if len(set(hosts.values())) < 2:
        return
    moved, same, crowded = [], [], []
    for ranks, pairs in sorted(pairings.items()):
        group_hosts = [hosts[r] for r in ranks]
        if pairs != pairing.natural_pairs(len(ranks)):
            moved.append(", ".join(f"{ranks[a]}+{ranks[b]}" for a, b in pairs))
        bad = pairing.same_host_pairs(pairs, group_hosts)
        if bad:
            same += [(ranks[a], ranks[b], group_hosts[a]) for a, b in bad]
            host, n = pairing.crowded_host(group_hosts)
            crowded.append(f"{host} holds {n} of the {len(ranks)} ranks of DP group "
                           f"{list(ranks)[:8]}{' ...' if len(ranks) > 8 else ''}")
    if moved:
        print_rank_0("mindio_ttp: optimizer partners paired across hosts (ranks r+q hold one "
                     "shard together): " + "; ".join(moved[:4])
                     + (f"; and {len(moved) - 4} more DP groups" if len(moved) > 4 else ""))
    if not same:
        return
    total = sum(len(ranks) // 2 for ranks in pairings)
    head = ", ".join(f"ranks {a} and {b} on {h}" for a, b, h in same[:4])
    more = f" and {len(same) - 4} more" if len(same) > 4 else ""
    msg = (f"mindio_ttp: {len(same)} optimizer shard(s) of {total} have both copies on one "
           f"host ({head}{more}): losing that host loses the shard and the dying checkpoint. "
           f"No pairing can avoid it: {'; '.join(crowded[:2])}, more than half. Place the "
           "ranks so that no host holds more than half of any DP group (with Megatron's rank "
           "order a DP group is the ranks r, r + TP, r + 2 TP, ... of one pipeline stage: spread "
           "every stage over at least two hosts)")
    if os.environ.get(ttp_config.ENV_REQUIRE_CROSS_HOST_REPLICAS, "") == "1":
        raise RuntimeError(msg + f"; refusing to start because "
                           f"{ttp_config.ENV_REQUIRE_CROSS_HOST_REPLICAS}=1")
    print_rank_0("WARNING: " + msg)
