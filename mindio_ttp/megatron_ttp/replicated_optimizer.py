"""`ReplicatedOptimizer`: Megatron's distributed optimizer with every state shard on two ranks.

The DP group is cut into `replica_count` equal runs of positions; each run shards the optimizer
state over itself, so positions i and i + dp/replica_count hold the same shard (the layout the
TTP controller assumes). When a rank dies, a partner still holds its shard and the dying
checkpoint can be written.

The TTP contract forbids collectives between `ttp_start_updating_os` and `ttp_end_updating_os`:
a rank killed there must not leave survivors blocked half-updated. So every collective of the
update (grad all-reduce, inf check, grad norm, zero count) runs in `reduce_model_grads`, whose
results `step` only reads; the parameter all-gather stays in `gather_model_params`, after the
window. Norm and zero count take contributions from the first replica only, so nothing is
counted twice.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import mpu
from megatron.optimizer.distrib_optimizer import DistributedOptimizer, Range

from .. import framework_ttp
from . import layout
from .layout import PARAM_KEY, BufferSpec, Cut, ParamSpec
from .step_record import StepRecord

DEFAULT_REPLICAS = 2
_FLOAT16 = (torch.float16, torch.bfloat16)


class ReplicatedOptimizer(StepRecord, DistributedOptimizer):
    """Drop-in for `DistributedOptimizer` (same constructor) that keeps each shard twice."""

    def __init__(self, optimizer, clip_grad, log_num_zeros_in_grad, params_have_main_grad,
                 use_contiguous_buffers_in_local_ddp, fp16, bf16, params_dtype, grad_scaler,
                 models, replica_count: Optional[int] = None):
        dp = mpu.get_data_parallel_world_size()
        if replica_count is None:
            replica_count = DEFAULT_REPLICAS  # what the guide's len(dp_ranks)//2 means
        if replica_count < 1 or dp % replica_count:
            raise ValueError(
                f"ReplicatedOptimizer: data-parallel size {dp} is not divisible by the replica "
                f"count {replica_count}; choose a DP size that is a multiple of {replica_count}"
            )
        self.replica_count = replica_count
        self.num_shards = dp // replica_count
        # One source for the layout: the runtime refuses a `replica` that disagrees.
        framework_ttp.declare_optimizer_shards(self.num_shards)
        self.dp_position = mpu.get_data_parallel_rank()
        self.shard_index = self.dp_position % self.num_shards
        self.replica_index = self.dp_position // self.num_shards
        self.dp_ranks: List[int] = list(
            torch.distributed.get_process_group_ranks(mpu.get_data_parallel_group())
        )
        # The original groups still list whole model params; the base constructor replaces them.
        self._orig_groups = list(optimizer.param_groups)
        self._param_group = {
            p: gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]
        }
        self.shard_cut = Cut(parts=self.num_shards, stock=False)
        self.stock_cut = Cut(parts=dp, stock=True)  # DistributedOptimizer's, for checkpoints
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, params_have_main_grad,
                         use_contiguous_buffers_in_local_ddp, fp16, bf16, params_dtype,
                         grad_scaler, models)
        self.buffer_specs = self._describe_buffers()
        self.replica_group = self._build_replica_groups()
        self._pending: Optional[Tuple[bool, Optional[float], Optional[float]]] = None
        self._init_step_record()

    # ---- layout -------------------------------------------------------------------------

    def build_model_gbuf_range_map(self, model):
        """Ranges over `num_shards` shards; part size numel_padded/num_shards so that the
        all-gather views and the owned ranges agree."""
        result = {}
        for dtype, gbuf in model._grad_buffers.items():
            size = gbuf.numel_padded // self.num_shards
            all_ranges = [Range(min(gbuf.numel, r * size), min(gbuf.numel, (r + 1) * size))
                          for r in range(self.num_shards)]
            world = all_ranges[self.shard_index]
            result[dtype] = {
                "local": world.normalize(),
                "world": world,
                "world_all": all_ranges,
                "param_map": self.build_model_gbuf_param_range_map(model, dtype, world),
                "max_range_size": size,
            }
        return result

    def _describe_buffers(self) -> List[BufferSpec]:
        specs = []
        for mi, model in enumerate(self.models):
            for dtype, gbuf in model._grad_buffers.items():
                params = tuple(
                    ParamSpec(index=i, start=s, end=e, group=self._param_group[p],
                              float16=p.dtype in _FLOAT16)
                    for i, (p, (s, e)) in enumerate(
                        model._grad_buffer_param_index_map[dtype].items())
                )
                specs.append(BufferSpec((mi, str(dtype)), gbuf.numel, gbuf.numel_padded, params))
        return specs

    def _build_replica_groups(self):
        """One process group per (DP group, replica run); every rank must create all of them."""
        world = torch.distributed.get_world_size()
        all_dp: List[Optional[List[int]]] = [None] * world
        torch.distributed.all_gather_object(all_dp, self.dp_ranks)
        mine = None
        for ranks in sorted({tuple(r) for r in all_dp}):
            for rep in range(self.replica_count):
                members = list(ranks[rep * self.num_shards:(rep + 1) * self.num_shards])
                group = torch.distributed.new_group(members, backend="gloo") \
                    if self.num_shards > 1 else None
                if torch.distributed.get_rank() in members:
                    mine = group
        return mine

    def model_params_by_buffer(self) -> Dict[layout.BufferKey, List[torch.nn.Parameter]]:
        out = {}
        for mi, model in enumerate(self.models):
            for dtype, pmap in model._grad_buffer_param_index_map.items():
                out[(mi, str(dtype))] = list(pmap.keys())
        return out

    def _slots_and_tensors(self):
        """(slot, main param tensor) for every param piece this rank's optimizer owns."""
        groups = layout.optimizer_groups(self.buffer_specs, self.shard_cut, self.shard_index,
                                         len(self._orig_groups))
        mains = [p for g in self.optimizer.param_groups for p in g["params"]]
        slots = [s for _, ss in groups for s in ss]
        if len(slots) != len(mains):
            raise RuntimeError(f"layout mismatch: {len(slots)} slots for {len(mains)} params")
        return groups, list(zip(slots, mains))

    # ---- flat state ---------------------------------------------------------------------

    def state_keys(self) -> Tuple[List[str], Dict[str, torch.Tensor]]:
        """Per-element state keys (sorted, plus the main param) and shared scalar state."""
        keys, scalars = set(), {}
        for _, main in self._slots_and_tensors()[1]:
            for k, v in self.optimizer.state.get(main, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == main.numel():
                    keys.add(k)
                else:
                    scalars.setdefault(k, v)
        return sorted(keys) + [PARAM_KEY], scalars

    def local_flat(self, keys) -> layout.FlatState:
        flat = layout.empty_flat(self.buffer_specs, keys)
        pairs = self._slots_and_tensors()[1]
        values = []
        for _, main in pairs:
            vals = {k: v for k, v in self.optimizer.state.get(main, {}).items() if k in keys}
            vals[PARAM_KEY] = main.detach().float()
            values.append(vals)
        layout.scatter_slots(flat, [s for s, _ in pairs], values)
        return flat

    def pack_local(self, keys) -> torch.Tensor:
        return layout.pack_owned(self.local_flat(keys), self.buffer_specs, self.shard_cut,
                                 self.shard_index, keys)

    def group_hparams(self) -> Dict[int, dict]:
        """Hyperparameters per original group index, from the live groups (the scheduler sets
        lr and weight decay there each step). A group with nothing in this shard keeps its
        construction-time values; Megatron's scheduler overwrites both when it loads."""
        hp = {i: {**self.optimizer.defaults, **g} for i, g in enumerate(self._orig_groups)}
        groups = layout.optimizer_groups(self.buffer_specs, self.shard_cut, self.shard_index,
                                         len(self._orig_groups))
        for (orig, _), live in zip(groups, self.optimizer.param_groups):
            hp[orig] = dict(live)
        return hp

    def stock_state_dict(self, flat: layout.FlatState, scalars, position: int) -> dict:
        """What Megatron's DistributedOptimizer at DP `position` returns from state_dict()."""
        groups = layout.optimizer_groups(self.buffer_specs, self.stock_cut, position,
                                         len(self._orig_groups))
        values = [layout.gather_slots(flat, slots) for _, slots in groups]
        inner = layout.inner_state_dict(groups, values, scalars, self.group_hparams())
        sd = {"optimizer": inner}
        if self.grad_scaler:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        sd["shard_fp32_from_float16_groups"] = [
            [v[PARAM_KEY] for s, v in zip(slots, vals) if s.param.float16]
            for (_, slots), vals in zip(groups, values)
        ]
        return sd

    # ---- Megatron optimizer API ---------------------------------------------------------

    def get_main_grads_for_grad_norm(self):
        if self.replica_index > 0:
            return []  # the first replica already counts these elements
        return super().get_main_grads_for_grad_norm()

    def count_zeros(self):
        params = self.get_parameters() if self.replica_index == 0 else []
        from megatron.optimizer.clip_grads import count_zeros_fp32
        return count_zeros_fp32(params, model_parallel_group=self.get_model_parallel_group())

    def reduce_model_grads(self, args, timers):
        """All collectives of the update: grad all-reduce, inf check, norm, zero count."""
        timers('layernorm-grads-all-reduce', log_level=1).start(
            barrier=args.barrier_with_L1_time)
        self.allreduce_layernorm_grads(args)
        timers('layernorm-grads-all-reduce').stop()
        timers('embedding-grads-all-reduce', log_level=1).start(
            barrier=args.barrier_with_L1_time)
        self.allreduce_embedding_grads(args)
        timers('embedding-grads-all-reduce').stop()
        timers('grads-all-reduce', log_level=1).start(barrier=args.barrier_with_L1_time)
        for model in self.models:
            model.allreduce_gradients()  # divides by the DP size, averages over the whole group
        timers('grads-all-reduce').stop()

        self._copy_model_grads_to_main_grads()
        found_inf = False
        if self.grad_scaler:
            found_inf = self._unscale_main_grads_and_check_for_nan()
        grad_norm = num_zeros = None
        if not found_inf:
            if self.clip_grad > 0.0:
                grad_norm = self.clip_grad_norm(self.clip_grad)
            if self.log_num_zeros_in_grad:
                num_zeros = self.count_zeros()
        self._pending = (found_inf, grad_norm, num_zeros)
        # Every collective of this update is done. Should this rank leave the step before its
        # update (the guide's barrier, next, fails for it while its partners pass it), the
        # runtime may still run the update while the rank waits for the verdict.
        framework_ttp.ttp_offer_update(self.current_step + 1, self._catch_up)

    def _catch_up(self) -> None:
        """What the patched train_step runs between ttp_start/end_updating_os: step() and
        increase_step() (the record of the step: consumed samples, scheduler count, RNG)."""
        from megatron import get_args

        self.step(get_args(), None)  # purely local; the timers are not used
        self.increase_step()

    @torch.no_grad()
    def step(self, args, timers):
        """Purely local: uses what reduce_model_grads computed."""
        if self._pending is None:
            raise RuntimeError("ReplicatedOptimizer.step() needs reduce_model_grads() first "
                               "(it runs the collectives of the update)")
        found_inf, grad_norm, num_zeros = self._pending
        self._pending = None
        self._last_found_inf = found_inf
        if self.grad_scaler:
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def gather_model_params(self, args, timers):
        timers('params-all-gather', log_level=1).start(barrier=args.barrier_with_L1_time)
        if self.num_shards > 1:
            for buffers in self.param_buffers:
                for _dtype, pbuf in buffers.items():
                    size = pbuf.numel() // self.num_shards
                    mine = pbuf[self.shard_index * size:(self.shard_index + 1) * size]
                    torch.distributed._all_gather_base(pbuf, mine.clone(),
                                                       group=self.replica_group)
        for model_id, model in enumerate(self.models):
            for dtype, param_map in model._grad_buffer_param_index_map.items():
                pbuf = self.param_buffers[model_id][dtype]
                for param, (start, end) in param_map.items():
                    param.view(-1).detach().copy_(pbuf[start:end])
        timers('params-all-gather').stop()

    def state_dict(self):
        """The stock DistributedOptimizer state of this DP position (collective over the
        replica run: its shard may live on the partner), so stock Megatron can load it."""
        keys, scalars = self.state_keys()
        flat = self.full_flat_from_replica_run(keys)
        return self.stock_state_dict(flat, scalars, self.dp_position)

    def full_flat_from_replica_run(self, keys) -> layout.FlatState:
        flat = layout.empty_flat(self.buffer_specs, keys)
        packed = self.pack_local(keys)
        if self.num_shards == 1:
            layout.unpack_owned(flat, packed, self.buffer_specs, self.shard_cut, 0, keys)
            return flat
        parts = [torch.empty_like(packed) for _ in range(self.num_shards)]
        torch.distributed.all_gather(parts, packed, group=self.replica_group)
        for shard, part in enumerate(parts):
            layout.unpack_owned(flat, part, self.buffer_specs, self.shard_cut, shard, keys)
        return flat

    def load_state_dict(self, state_dict):
        """Load this position's stock file; the DP group exchanges files to re-cut the shards
        (collective over the DP group)."""
        stock = self.stock_cut
        groups = layout.optimizer_groups(self.buffer_specs, stock, self.dp_position,
                                         len(self._orig_groups))
        per_slot, scalars = layout.split_inner_state(groups, state_dict["optimizer"])
        keys = sorted({k for vals in per_slot for v in vals for k in v})
        local_keys = keys + [PARAM_KEY]
        f16 = iter(t for g in state_dict.get("shard_fp32_from_float16_groups", []) for t in g)
        for (_, slots), vals in zip(groups, per_slot):
            for slot, v in zip(slots, vals):
                if slot.param.float16:
                    v[PARAM_KEY] = next(f16).reshape(-1).float()
        flat = layout.empty_flat(self.buffer_specs, local_keys)
        layout.scatter_slots(flat, [s for _, ss in groups for s in ss],
                             [v for vals in per_slot for v in vals])
        packed = layout.pack_owned(flat, self.buffer_specs, stock, self.dp_position, local_keys)
        parts = [torch.empty_like(packed) for _ in self.dp_ranks]
        torch.distributed.all_gather(parts, packed, group=mpu.get_data_parallel_group())
        for pos, part in enumerate(parts):
            layout.unpack_owned(flat, part, self.buffer_specs, stock, pos, local_keys)
        saved_hp = {orig: dict(saved) for (orig, _), saved in
                    zip(groups, state_dict["optimizer"]["param_groups"])}
        self._install_flat(flat, scalars, saved_hp)
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _install_flat(self, flat, scalars, saved_hp):
        groups, pairs = self._slots_and_tensors()
        values = layout.gather_slots(flat, [s for s, _ in pairs])
        hp = {**self.group_hparams(), **saved_hp}
        per_group = [values[offset:offset + len(slots)] for offset, slots in _offsets(groups)]
        self.optimizer.load_state_dict(layout.inner_state_dict(groups, per_group, scalars, hp))
        for (slot, main), vals in zip(pairs, values):
            if slot.param.float16:
                main.data.copy_(vals[PARAM_KEY].view_as(main))

    # ---- TTP hooks (see StepRecord) ---------------------------------------------------

    def memory_report(self) -> str:
        """Measured optimizer-state bytes on this rank, and what DistributedOptimizer would hold
        for the same grad buffers (its shard is 1/dp of each buffer, ours 1/num_shards)."""
        pairs = self._slots_and_tensors()[1]
        owned = sum(s.size for s, _ in pairs)
        state_bytes = sum(v.numel() * v.element_size() for _, m in pairs
                          for v in self.optimizer.state.get(m, {}).values()
                          if torch.is_tensor(v) and v.dim() > 0)
        state_bytes += sum(m.numel() * m.element_size() for s, m in pairs if s.param.float16)
        total = sum(b.numel for b in self.buffer_specs)
        stock_owned = sum(min(self.stock_cut.part_size(b), b.numel) for b in self.buffer_specs)
        per_elem = state_bytes / owned if owned else 0.0
        return (f"mindio_ttp: ReplicatedOptimizer rank {torch.distributed.get_rank()} "
                f"(DP position {self.dp_position}, shard {self.shard_index} of "
                f"{self.num_shards}, replica {self.replica_index}): {owned} of {total} params, "
                f"optimizer state {state_bytes} B = {state_bytes / total:.3f} B/param; "
                f"DistributedOptimizer would hold {stock_owned} params = "
                f"{per_elem * stock_owned / total:.3f} B/param")


def _offsets(groups):
    offset = 0
    for _, slots in groups:
        yield offset, slots
        offset += len(slots)
