"""The dying checkpoint: save handler (chosen ranks) and rename handler (one rank).

The save handler runs in the TTP processor's thread while the main thread may be stuck in a
collective with a dead rank, so nothing here touches Megatron's process groups. The chosen
ranks of one DP group (one holder per shard) swap their shards over a private gloo group built
on the store the save order names (the ordering controller hosts it: see exchange.py); then
each can rebuild the full state of step `step`: model weights from the fp32 main params (the
live model params may be one all-gather behind), and Megatron's own optimizer files, one per
DP rank, re-cut from the shards so stock Megatron can load them.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from megatron import get_args
from megatron.core import mpu
from megatron.utils import unwrap_model

from mindio_ttp import checkpoint_writer
from mindio_ttp.framework_ttp import save_session

from . import exchange, layout, manifest
from .layout import PARAM_KEY
from .replicated_optimizer import ReplicatedOptimizer


def parallel_layout() -> manifest.ParallelLayout:
    return manifest.ParallelLayout(
        tp=mpu.get_tensor_model_parallel_world_size(),
        pp=mpu.get_pipeline_model_parallel_world_size(),
        dp=mpu.get_data_parallel_world_size(),
    )


def ttp_save_checkpoint(step: int, save_ranks: List[int], ckpt_args: tuple) -> None:
    """Write step `step` into `<save>/.ttp_tmp_iter_XXXXXXX.<tag>/` (TTP save handler)."""
    args = get_args()
    if not args.save:
        raise RuntimeError("dying checkpoint: Megatron has no --save directory to write into")
    if not ckpt_args:
        raise RuntimeError(f"no training state registered yet (ttp_set_ckpt_args): cannot save "
                           f"step {step}")
    _, model, optimizer, scheduler = ckpt_args
    if not isinstance(optimizer, ReplicatedOptimizer):
        raise RuntimeError("dying checkpoint needs ReplicatedOptimizer "
                           "(--use-distributed-optimizer)")
    if optimizer.current_step != step:
        raise RuntimeError(f"asked to save step {step} but this rank finished step "
                           f"{optimizer.current_step}")
    meta = optimizer.step_meta(step)
    chosen = _chosen_in_my_dp_group(optimizer, save_ranks)
    tag = exchange.attempt_tag(step, save_ranks)
    me = torch.distributed.get_rank()

    root = manifest.tmp_root(args.save, step, _order_tag(step))
    # this order's own directory: nothing to clear, and another flow's is never touched
    exchange.barrier(exchange.gloo_group(save_ranks, me, f"{tag}/all/"))

    keys, scalars = optimizer.state_keys()
    flat = _exchange_shards(optimizer, chosen, keys, tag)

    par = parallel_layout()
    iter_dir = root / manifest.iter_dir_name(step)
    iter_dir.mkdir(parents=True, exist_ok=True)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    written: Dict[str, Dict[str, object]] = {}
    if optimizer.shard_index == 0:
        state = _model_state(step, model, optimizer, flat, meta, args)
        rel = par.model_file(tp_rank, pp_rank)
        written[rel] = _save(iter_dir, rel, state)
    sched = dict(scheduler.state_dict())
    sched["num_steps"] = meta["scheduler_num_steps"]  # the live one may be one step ahead
    for position in range(par.dp):
        if position % optimizer.num_shards != optimizer.shard_index:
            continue
        state = {"optimizer": optimizer.stock_state_dict(flat, scalars, position),
                 "opt_param_scheduler": sched}
        rel = par.optim_file(tp_rank, pp_rank, position)
        written[rel] = _save(iter_dir, rel, state)
    manifest.write_part(iter_dir, torch.distributed.get_rank(), written)


def rename_save_result(step: int, ckpt_args: tuple) -> None:
    """Make step `step` visible: merge the manifest, move the directory, then the tracker."""
    args = get_args()
    save_dir = Path(args.save)
    root = manifest.tmp_root(args.save, step, _order_tag(step))
    staged = root / manifest.iter_dir_name(step)
    manifest.merge_parts(staged, step, parallel_layout())
    final = save_dir / manifest.iter_dir_name(step)
    if final.exists():  # another flow's checkpoint, or a periodic save: never replaced
        raise RuntimeError(f"{final} already exists: not replacing it with the dying "
                           f"checkpoint (left in {root}); the tracker is unchanged")
    staged.rename(final)  # a race with another renamer fails here: rename(2) onto a non-empty
    # directory is refused
    manifest.write_tracker(save_dir, step)
    shutil.rmtree(root, ignore_errors=True)
    print(f"ttp: dying checkpoint of iteration {step} is in {final}", flush=True)


def checkpoint_location(step: int) -> str:
    """Where `rename_save_result` puts step `step` (any rank can say: every rank has --save);
    absolute, because ttprun prints it and need not share the workers' working directory."""
    return str((Path(get_args().save) / manifest.iter_dir_name(step)).absolute())


# read by every rank's exit path for flow-finished.json (see mindio_ttp.framework_ttp)
rename_save_result.checkpoint_location = checkpoint_location  # type: ignore[attr-defined]


def _order_tag(step: int) -> str:
    session = save_session.current()
    return session.tag if session is not None and session.step == step else ""


def _chosen_in_my_dp_group(optimizer: ReplicatedOptimizer, save_ranks: Sequence[int]) -> List[int]:
    """The chosen ranks of my DP group, ordered by shard; one per shard or refuse."""
    mine = [r for r in save_ranks if r in optimizer.dp_ranks]
    by_shard: Dict[int, int] = {}
    for r in mine:
        shard = optimizer.dp_ranks.index(r) % optimizer.num_shards
        if shard in by_shard:
            raise RuntimeError(f"save ranks {sorted(save_ranks)} name two holders "
                               f"({by_shard[shard]}, {r}) of shard {shard} of DP group "
                               f"{optimizer.dp_ranks}")
        by_shard[shard] = r
    if sorted(by_shard) != list(range(optimizer.num_shards)):
        raise RuntimeError(f"save ranks {sorted(save_ranks)} do not hold every shard of DP group "
                           f"{optimizer.dp_ranks}")
    return [by_shard[s] for s in range(optimizer.num_shards)]


def _exchange_shards(optimizer: ReplicatedOptimizer, chosen: List[int], keys, tag: str):
    """Full flat state of my DP group from the chosen holders, over a private gloo group."""
    packed = optimizer.pack_local(keys)
    flat = layout.empty_flat(optimizer.buffer_specs, keys)
    cut = optimizer.shard_cut
    me = torch.distributed.get_rank()
    group = exchange.gloo_group(chosen, me, f"{tag}/dp-{'-'.join(map(str, chosen))}/")
    parts = exchange.allgather(group, packed, len(chosen))  # in global-rank order
    for rank, part in zip(sorted(chosen), parts):
        layout.unpack_owned(flat, part, optimizer.buffer_specs, cut, chosen.index(rank), keys)
    return flat


def _model_state(step, model, optimizer: ReplicatedOptimizer, flat, meta, args) -> dict:
    """model_rng.pt as Megatron writes it at `step`, weights rebuilt from the main params."""
    saved_args = copy.copy(args)
    saved_args.consumed_train_samples = meta["consumed_train_samples"]
    saved_args.consumed_valid_samples = meta["consumed_valid_samples"]
    saved_args.curr_iteration = step - 1
    rebuilt = {}
    specs = {b.key: b for b in optimizer.buffer_specs}
    for key, params in optimizer.model_params_by_buffer().items():
        full = flat[key][PARAM_KEY]
        for spec, param in zip(specs[key].params, params):
            rebuilt[param.data_ptr()] = full[spec.start:spec.end].view(param.shape).to(param.dtype)
    state = {"args": saved_args, "checkpoint_version": 3.0, "iteration": step}
    chunks = unwrap_model(model)
    for i, chunk in enumerate(chunks):
        if len(chunks) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(i)
        sd = _replace_tensors(chunk.state_dict_for_save_checkpoint(), rebuilt)
        state["model" if len(chunks) == 1 else f"model{i}"] = sd
    if not args.no_save_rng:
        state["rng_state"] = [meta["rng_state"]]
    return state


def _replace_tensors(tree, rebuilt):
    """Copy of a nested state dict where trained params are replaced by their step values."""
    if isinstance(tree, dict):
        out = type(tree)()
        for k, v in tree.items():
            out[k] = _replace_tensors(v, rebuilt)
        return out
    if torch.is_tensor(tree) and tree.data_ptr() in rebuilt:
        value = rebuilt[tree.data_ptr()]
        if value.shape == tree.shape:
            return value
    return tree


def _save(iter_dir: Path, rel: str, state) -> Dict[str, object]:
    """Stream `state` into `iter_dir/rel` (checkpoint_writer: hashed while written, no copy of
    the file in memory, device tensors read on a private stream); its manifest entry."""
    return checkpoint_writer.write_torch(iter_dir / rel, state).entry()
