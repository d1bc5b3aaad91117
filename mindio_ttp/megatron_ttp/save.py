"""The dying checkpoint: save handler (chosen ranks) and rename handler (one rank).

The save handler runs in the TTP processor's thread while the main thread may be stuck in a
collective with a dead rank, so nothing here touches Megatron's process groups.

Exchange-free: every DP position holds its own stock stripe and its partner's
(replicated_optimizer.py), so each chosen rank writes Megatron's own optimizer file of its
position from its own memory, and the partner's file too when the partner is not among the
savers (dead, or not chosen). Ranks write in parallel, each its own files. Before any read,
`device_copy.prepare` notes what the device finished and stops its work (faulttime/abort.py).

The model file (one per TP/PP rank, written by the chosen rank of the DP group with the lowest
DP position) needs every weight of the step: when the device says this step's param all-gather
and its copies finished on the writer (the common case: a fault in forward/backward), the live
weights are the step's and nothing moves. Otherwise (a fault between the update and the end of
the all-gather, or an all-gather hung on a dead peer) the other chosen ranks of the DP group send
their fp32 main params to the writer alone, over 2-rank gloo groups with CPU tensors built on
the store the save order names (exchange.py). Optimizer state never moves.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from megatron.core import mpu
from megatron.utils import unwrap_model

from mindio_ttp.faulttime import checkpoint_writer, device_copy, manifest, save_session
from mindio_ttp.megatron_ttp import exchange, log_record
from mindio_ttp.megatron_ttp.rejoin import megatron_args as get_args
from mindio_ttp.megatron_ttp.replicated_optimizer import ReplicatedOptimizer

log = logging.getLogger("mindio_ttp.checkpoint")


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
    positions, writes_model = optimizer.save_plan(save_ranks)
    tag = exchange.attempt_tag(step, save_ranks)
    place = optimizer.place  # not mpu / torch.distributed: see ReplicatedOptimizer.place
    me = place.rank

    started = time.perf_counter()
    root = manifest.tmp_root(args.save, step, _order_tag(step))
    # this order's own directory: nothing to clear, and another flow's is never touched.
    # Before any device read: what the device finished (noted first), then stop its work.
    ready = device_copy.prepare(step)
    # The model file of this DP group needs every weight of `step`: its writer's live params
    # when their all-gather finished on the device, else the fp32 main params of the chosen
    # ranks, gathered to the writer alone. The writer decides, the others follow.
    prepared = time.perf_counter()
    full = _main_params_if_needed(optimizer, save_ranks, tag, writes_model, ready.gathered)
    exchanged = time.perf_counter()

    par = place.layout
    iter_dir = root / manifest.iter_dir_name(step)
    iter_dir.mkdir(parents=True, exist_ok=True)
    tp_rank, pp_rank = place.tp_rank, place.pp_rank
    written: Dict[str, Dict[str, object]] = {}
    files: List[checkpoint_writer.Written] = []
    if writes_model:
        state = _model_state(step, model, optimizer, full, meta, args)
        rel = par.model_file(tp_rank, pp_rank)
        files.append(_save(iter_dir, rel, state, live_params=full is None))
        written[rel] = files[-1].entry()
    sched = dict(scheduler.state_dict())
    sched["num_steps"] = meta["scheduler_num_steps"]  # the live one may be one step ahead
    lr, wd = _hyperparams_at(scheduler, meta["scheduler_num_steps"])
    for position in positions:  # own stripe, and the partner's when the partner is not saving
        state = {"optimizer": _with_hyperparams(optimizer.stripe_state_dict(position), lr, wd),
                 "opt_param_scheduler": sched}
        rel = par.optim_file(tp_rank, pp_rank, position)
        files.append(_save(iter_dir, rel, state))
        written[rel] = files[-1].entry()
    kept = log_record.for_checkpoint(step) if writes_model and tp_rank == 0 and \
        pp_rank == par.pp - 1 else None  # one rank: the last stage's model writer
    if kept is not None:  # the step's log line and scalars, if no run printed them
        files.append(_save(iter_dir, manifest.STEP_LOG, kept))
        written[manifest.STEP_LOG] = files[-1].entry()
    parted = time.perf_counter()
    manifest.write_part(iter_dir, me, written)
    done = time.perf_counter()
    phases = {k: sum(f.phases.get(k, 0.0) for f in files)
              for k in ("serialize", "write", "digest", "fsync", "rename")}
    log.info("dying save of step %d on rank %d (model file: %s): %d file(s), %d bytes in %.3f "
             "s: device ready %.3f, exchange %.3f, serialize %.3f, write %.3f, digest %.3f (%s), "
             "fsync %.3f, rename %.3f, part manifest %.3f, other %.3f", step, me,
             ("none" if not writes_model else "live params" if full is None
              else "rebuilt from the main params"), len(files),
             sum(f.size for f in files), done - started, prepared - started,
             exchanged - prepared, phases["serialize"], phases["write"], phases["digest"],
             "/".join(sorted({f.algo for f in files})) or "-", phases["fsync"],
             phases["rename"], done - parted,
             parted - exchanged - sum(f.seconds for f in files))


def rename_save_result(step: int, ckpt_args: tuple) -> None:
    """Make step `step` visible: merge the manifest, move the directory, then the tracker."""
    args = get_args()
    started = time.perf_counter()
    save_dir = Path(args.save)
    root = manifest.tmp_root(args.save, step, _order_tag(step))
    staged = root / manifest.iter_dir_name(step)
    manifest.merge_parts(staged, step, ckpt_args[2].place.layout)
    merged = time.perf_counter()
    final = save_dir / manifest.iter_dir_name(step)
    if final.exists():
        _move_megatrons_own_aside(final, root / f"cut_{final.name}", step, root)
    staged.rename(final)  # a race with another renamer fails here: rename(2) onto a non-empty
    # directory is refused
    renamed = time.perf_counter()
    newer = _newer_latest(save_dir, step)
    if newer is None:
        manifest.write_tracker(save_dir, step)
    # (bench/bench_dying_save.py reads this line's words)
    log.info("dying checkpoint of step %d %s: merge manifest %.3f s, rename %.3f s, "
             "tracker %.3f s", step, "marked latest" if newer is None else
             f"kept, not marked latest (latest is the newer {newer})", merged - started,
             renamed - merged, time.perf_counter() - renamed)
    shutil.rmtree(root, ignore_errors=True)
    # earlier attempts of this save (a failed saver was replaced: each attempt stages in its
    # own directory), never visible to a loader, now only debris
    for earlier in save_dir.glob(manifest.tmp_root("", step, "*").name):
        shutil.rmtree(earlier, ignore_errors=True)
    if newer is None:
        print(f"ttp: dying checkpoint of iteration {step} is in {final}", flush=True)
    else:
        print(f"ttp: dying checkpoint of iteration {step} is in {final}, NOT marked latest: "
              f"{manifest.TRACKER} names iteration {newer}, which is newer (both kept)",
              flush=True)


def _newer_latest(save_dir: Path, step: int) -> Optional[int]:
    """The iteration the tracker names when it is newer than `step`, else None. A dying
    checkpoint never moves `latest` back: a run started without --load (from iteration 0)
    into a directory holding iteration 605 would otherwise replace it as what a rerun loads.
    An unreadable tracker names nothing (the dying checkpoint is then marked latest)."""
    try:
        named, _ = manifest.read_tracker(save_dir)
    except manifest.TrackerError:
        return None
    return named if named is not None and named > step else None


def latest_iteration() -> Optional[int]:
    """The iteration Megatron's tracker names now (None: none, or unreadable), for the flow
    record: ttprun says when the dying checkpoint is not the one a rerun loads."""
    try:
        return manifest.read_tracker(Path(get_args().save))[0]
    except Exception:  # noqa: BLE001 - asked on a rank's way out: never raise
        return None


def _move_megatrons_own_aside(final: Path, cut: Path, step: int, root: Path) -> None:
    """`final` exists: another flow's checkpoint (TTP's marker or manifest in it) is never
    replaced. A stock one is Megatron's own save of this very step, which the fault cut short
    (a periodic save, or the final save pretrain writes after train(): a rank killed there
    leaves a file missing or truncated, maybe the tracker) or let finish: the same step's
    state, while the dying checkpoint's is complete and checked. It goes aside into this
    order's hidden staging directory first (removed with it), so no loader ever sees a mix of
    the two; a crash between the two renames leaves no iter directory of `step`, which the
    validated loader skips for the newest complete one."""
    if (final / manifest.MARKER).exists() or (final / manifest.MANIFEST).exists():
        raise RuntimeError(f"{final} already exists and was written by TTP: not replacing it "
                           f"with the dying checkpoint (left in {root}); the tracker is "
                           "unchanged")
    final.rename(cut)
    print(f"ttp: {final}, Megatron's own save of iteration {step} (cut short or not), is "
          "replaced by the dying checkpoint", flush=True)


def checkpoint_location(step: int) -> str:
    """Where `rename_save_result` puts step `step` (any rank can say: every rank has --save);
    absolute, because ttprun prints it and need not share the workers' working directory."""
    return str((Path(get_args().save) / manifest.iter_dir_name(step)).absolute())


# read by every rank's exit path for flow-finished.json (see mindio_ttp.framework_ttp)
rename_save_result.checkpoint_location = checkpoint_location  # type: ignore[attr-defined]
rename_save_result.latest_iteration = latest_iteration  # type: ignore[attr-defined]


def _order_tag(step: int) -> str:
    session = save_session.current()
    return session.tag if session is not None and session.step == step else ""


def _hyperparams_at(scheduler, num_steps: int) -> tuple:
    """lr and weight decay as the scheduler sets them after its step to `num_steps`. A fault
    can land between the update of step k and the scheduler's step of k (the live groups then
    still hold k's lr): Megatron's own save of k writes the lr for k + 1."""
    at = copy.copy(scheduler)
    at.num_steps = num_steps
    return at.get_lr(), at.get_wd()


def _with_hyperparams(stripe_state: dict, lr: float, wd: float) -> dict:
    """`stripe_state` with every param group's lr and weight decay those of the saved step
    (what OptimizerParamScheduler.step writes: the value times the group's multiplier)."""
    inner = dict(stripe_state["optimizer"])
    inner["param_groups"] = [
        {**group, "lr": lr * group.get("lr_mult", 1.0),
         "weight_decay": wd * group.get("wd_mult", 1.0)}
        for group in inner["param_groups"]
    ]
    return {**stripe_state, "optimizer": inner}


def _stripe_chunks(optimizer: ReplicatedOptimizer) -> Dict[int, List[torch.Tensor]]:
    """fp32 main params of each stripe this rank holds: {position: one chunk per buffer},
    each chunk the stock range of that position, padded to the stock range size."""
    out: Dict[int, List[torch.Tensor]] = {}
    for stripe in optimizer.stripes():
        mains = stripe.main_of()
        chunks = []
        for mi, model in enumerate(optimizer.models):
            for dtype in model._grad_buffers:
                rng = stripe.gbuf_ranges[mi][dtype]
                chunk = torch.zeros(rng["max_range_size"], dtype=torch.float32)
                for param, ranges in rng["param_map"].items():
                    local = ranges["gbuf_local"]
                    chunk[local.start:local.end] = mains[id(param)].detach().view(-1).cpu()
                chunks.append(chunk)
        out[stripe.position] = chunks
    return out


def _main_params_if_needed(optimizer: ReplicatedOptimizer, save_ranks: Sequence[int], tag: str,
                           writes_model: bool,
                           gathered: bool) -> Optional[Dict[tuple, torch.Tensor]]:
    """The full fp32 main params of every grad buffer of my DP group, on the model-file writer
    when its live params are not those of the step (None elsewhere, and when they are).

    One flag decides: the writer's ("did my params of this step reach the model", from the
    device), set on the save order's store and read by the other chosen ranks of the DP group:
    one store operation per rank, whatever the DP size, and no process group. Only when the
    writer needs them does each other chosen rank send its two stripes to the writer, over a
    2-rank gloo group of its own (CPU tensors, read on the private stream): the writer holds
    one DP group's fp32 weights, the others only their own stripes."""
    me = optimizer.place.rank  # not torch.distributed: see ReplicatedOptimizer.place
    chosen = sorted(r for r in save_ranks if r in optimizer.dp_ranks)
    writer = min(chosen, key=optimizer.dp_ranks.index)
    prefix = f"{tag}/dp-{'-'.join(map(str, chosen))}/"
    store, timeout = exchange.order_store()
    senders = [r for r in chosen if r != writer]
    if writes_model:
        if senders:
            exchange.share_flag(store, prefix + "rebuild", not gathered)
        if gathered:
            return None
    elif not exchange.read_flag(store, prefix + "rebuild", timeout):
        return None
    with device_copy.reading():  # device -> host on the private stream, not the training one
        mine = _stripe_chunks(optimizer)
    packed = torch.cat([c for position in sorted(mine) for c in mine[position]])
    if not writes_model:
        exchange.send_to(store, prefix, me, packed, timeout)
        return None
    parts = {me: packed}
    parts.update(exchange.receive_from(store, prefix, senders, packed.numel(), timeout))
    keys = [(mi, dtype) for mi, model in enumerate(optimizer.models)
            for dtype in model._grad_buffers]
    sizes = [c.numel() for c in mine[optimizer.dp_position]]
    full: Dict[tuple, torch.Tensor] = {
        key: torch.zeros(size * optimizer.dp_size, dtype=torch.float32)
        for key, size in zip(keys, sizes)}
    for rank, part in parts.items():
        pos = optimizer.dp_ranks.index(rank)
        offset = 0
        for position in sorted({pos, optimizer.partner_of(pos)}):
            for key, size in zip(keys, sizes):
                full[key][position * size:(position + 1) * size] = part[offset:offset + size]
                offset += size
    return full


def _model_state(step, model, optimizer: ReplicatedOptimizer, full, meta, args) -> dict:
    """model_rng.pt as Megatron writes it at `step`: the live weights when this rank's param
    all-gather of `step` finished, else weights rebuilt from the exchanged main params."""
    saved_args = copy.copy(args)
    saved_args.consumed_train_samples = meta["consumed_train_samples"]
    saved_args.consumed_valid_samples = meta["consumed_valid_samples"]
    saved_args.curr_iteration = step - 1
    rebuilt = {}
    if full is not None:
        for mi, chunk_model in enumerate(optimizer.models):
            for dtype, pmap in chunk_model._grad_buffer_param_index_map.items():
                values = full[(mi, dtype)]
                for param, (start, end) in pmap.items():
                    rebuilt[param.data_ptr()] = values[start:end].view(param.shape).to(
                        param.dtype)
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


def _save(iter_dir: Path, rel: str, state,
          live_params: bool = False) -> checkpoint_writer.Written:
    """Stream `state` into `iter_dir/rel` (checkpoint_writer: digested while written, no copy
    of the file in memory, device tensors read on a private stream)."""
    return checkpoint_writer.write_torch(iter_dir / rel, state, live_params=live_params)
