"""The loss curve has no hole: after an in-memory recovery, the kept step's log line and
TensorBoard scalars appear exactly once, with the values an uninterrupted run prints (issue 23).

Megatron-LM 285068c's `training_log` (megatron/training.py:472) writes step k's TensorBoard
scalars, waits in a barrier of every rank (`timers('interval-time').elapsed(barrier=True)`,
line 602), prints the line on the last rank, then gathers the timers of every rank. A rank lost
after the update of k and before that barrier leaves k complete on every survivor (the recovery
keeps it and does not redo it) and its line never printed; the last rank's own loss kills its
unflushed scalars too (the writer queues them, `--tensorboard-queue-size` deep, and flushes
every 120 s).

`@mega.step_log` on `training_log` (edit 2.12) keeps, on every rank, the arguments of its last
call (references to a few one-element tensors and numbers: no copy, no device read per step) and
whether the call got past that barrier. The reset of the interval's counters in
`total_loss_dict` (`advanced` and `skipped iterations` set to 0 right before the print) says
so, also when the call raised later (in the timers' gather). On the last rank it flushes the
writer once the call returned, so what a step logged is on disk before the next step starts.

After a recovery to step t, every rank's record goes into the recovery's all-gather of digests
(refill.py), so every rank takes the same decision, and all of them call Megatron's own
`training_log` for t again (its collectives need every rank) when:

* the line of t was not printed: the last rank, when it survived, knows it from its record;
  when it was lost, the survivors' barrier says it (every survivor got past the barrier of t,
  which needed the last rank in it, or not; a loss in the instant between the last rank's
  barrier and its print is the one case this reads wrong);
* or its scalars are not on disk: the last rank, when it survived, wrote them (its writer was
  closed, so flushed, when it left the old world); its replacement reads the event files.

The values come from a record of t on a rank of the last pipeline stage (every one holds the
step's reduced losses); during the call the last rank prints only what is missing (its stdout is
set aside when the line was printed, its writer when the scalars are on disk). The time per
iteration it prints is 0.0: the time of a step is not kept. Without any record of t (every rank
of the last stage lost the step in the parameter all-gather after its update, before it logged)
nothing is printed for t.

The dying checkpoint has the same hole: a step finished on every survivor but stopped in that
barrier is saved, and the resumed run starts after it, so no run prints it. The rank that
writes the last stage's model file (TP rank 0) also writes its record of the step into the
checkpoint (`manifest.STEP_LOG`, listed in the manifest like every file, so verified and, with
TTP_CHECKPOINT_KEY, MACed); the tensors are read by the checkpoint writer on its private stream,
never on a stream a hung collective holds (they are final: the update's grad norm was read on
the host after them). When a run loads that checkpoint, every rank agrees that the record is
there and valid, and all call `training_log` for the step once more (`after_load`), as after a
recovery: the line when its barrier was not passed, the scalars when the event files lack them.
A run that loads the same checkpoint twice prints the line twice.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

log = logging.getLogger("mindio_ttp.recovery")
F = TypeVar("F", bound=Callable[..., Any])

ADVANCED, SKIPPED = "advanced iterations", "skipped iterations"  # training_log's keys


@dataclass
class LogRecord:
    """`training_log`'s arguments at its call for `iteration` (one-element tensors or numbers;
    `_plain` makes them numbers)."""

    iteration: int
    loss_dict: Dict[str, Any]
    total_loss_dict: Dict[str, Any]  # tensors for the loss sums, ints for the counters
    learning_rate: Any
    loss_scale: Any
    skipped_iter: int
    grad_norm: Any
    params_norm: Any
    num_zeros_in_grad: Any
    passed: bool = False  # got past the barrier before the print (this rank)
    last_stage: bool = False  # holds the step's reduced losses (the last pipeline stage)
    called: bool = True  # training_log was called (False: kept by step_losses, see below)


_last: Optional[LogRecord] = None


def last() -> Optional[LogRecord]:
    return _last


def _number(value: Any) -> Any:
    if value is None or isinstance(value, (int, float)):
        return value
    return value.item()  # a one-element tensor


def step_log(training_log: F) -> F:
    """Edit 2.12: record each call of `training_log` (see the module's doc)."""

    @functools.wraps(training_log)
    def wrapper(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad):
        global _last
        from megatron.core import mpu

        # references, not values: reading a device tensor would wait for the device every
        # step; training_log replaces the entries of total_loss_dict, it never writes into one
        record = LogRecord(iteration, dict(loss_dict), dict(total_loss_dict), learning_rate,
                           loss_scale, int(skipped_iter), grad_norm, params_norm,
                           num_zeros_in_grad,
                           last_stage=mpu.is_pipeline_last_stage(ignore_virtual=True))
        _last = record
        try:
            out = training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                               report_memory_flag, skipped_iter, grad_norm, params_norm,
                               num_zeros_in_grad)
        finally:
            record.passed = _past_the_barrier(total_loss_dict)
        _flush_writer()
        return out

    return wrapper  # type: ignore[return-value]


def step_losses(train_step: F) -> F:
    """Edit 2.13: keep what `train_step` computed of a step it updated but did not finish (its
    parameter all-gather raised, the peer lost after the update): the microbatches' reduced
    losses (from the loss function the forward step returns, as Megatron collects them),
    whether the update succeeded and its gradient norm (ReplicatedOptimizer.step). The step is
    then complete on this rank (a recovery keeps it) but `training_log` never ran for it."""

    @functools.wraps(train_step)
    def wrapper(forward_step_func, *args, **kwargs):
        from megatron import get_args

        step = get_args().curr_iteration + 1
        losses: List[Dict[str, Any]] = []

        def forward_step(*a, **k):
            out = forward_step_func(*a, **k)
            if not (isinstance(out, tuple) and len(out) == 2 and callable(out[1])):
                return out
            output_tensor, loss_func = out

            def kept_loss_func(*x, **y):
                result = loss_func(*x, **y)
                if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
                    losses.append(result[1])
                return result

            return output_tensor, kept_loss_func

        try:
            return train_step(forward_step, *args, **kwargs)
        except BaseException:
            _keep_unlogged(step, losses, args[2] if len(args) > 2 else kwargs.get("optimizer"))
            raise

    return wrapper  # type: ignore[return-value]


def _keep_unlogged(step: int, losses: List[Dict[str, Any]], optimizer: Any) -> None:
    """The record of a step this rank updated whose train_step raised after the update."""
    global _last
    if getattr(optimizer, "current_step", None) != step:
        return  # not updated here: not a step a recovery keeps from this rank
    if _last is not None and _last.iteration >= step:
        return
    from megatron.core import mpu

    ok, grad_norm, num_zeros = getattr(optimizer, "last_update", (True, None, None))
    reduced = {key: sum(x[key] for x in losses) / len(losses)
               for key in (losses[0] if losses else {})}  # as train_step averages them
    _last = LogRecord(step, reduced, {}, None, None, 0 if ok else 1, grad_norm, None,
                      num_zeros, passed=False, called=False,
                      last_stage=mpu.is_pipeline_last_stage(ignore_virtual=True))


def _past_the_barrier(total_loss_dict: Dict[str, Any]) -> bool:
    """training_log zeroes both counters right before it prints, after the barrier; it
    raised one of them at its start (nothing before can fail)."""
    return total_loss_dict.get(ADVANCED, 0) == 0 and total_loss_dict.get(SKIPPED, 0) == 0


def _flush_writer() -> None:
    from megatron import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()


# -- after a recovery ------------------------------------------------------------------------------
def entry(step: int, replacement: bool, last_rank: bool) -> Dict[str, Any]:
    """This rank's part of the recovery's all-gather: its record of `step` (if any), whether it
    survived, and on the last rank whether the step's scalars are missing from disk."""
    rec = _last if _last is not None and _last.iteration == step else None
    out: Dict[str, Any] = {"record": _plain(rec) if rec is not None else None,
                           "survivor": not replacement}
    if last_rank:
        out["scalars_missing"] = _scalars_missing(step, rec, replacement)
    return out


def _plain(rec: LogRecord) -> Dict[str, Any]:
    """The record as plain numbers (its tensors read now, once, at the recovery)."""
    out = {f.name: getattr(rec, f.name) for f in fields(rec)}
    for name in ("loss_dict", "total_loss_dict"):
        out[name] = {k: _number(v) for k, v in out[name].items()}
    for name in ("learning_rate", "loss_scale", "grad_norm", "params_norm", "num_zeros_in_grad"):
        out[name] = _number(out[name])
    return out


def _scalars_missing(step: int, rec: Optional[LogRecord], replacement: bool) -> bool:
    from megatron import get_args

    if replacement:
        return _scalars_missing_on_disk(step)
    if not _scalars_due(step):
        return False
    # training_log writes them before anything that may fail (no timers)
    return rec is None or not rec.called or (bool(get_args().log_timers_to_tensorboard)
                                              and not rec.passed)


def _scalars_due(step: int) -> bool:
    """This rank writes TensorBoard scalars, and `step` is one it writes them for."""
    from megatron import get_args, get_tensorboard_writer

    return get_tensorboard_writer() is not None and \
        step % get_args().tensorboard_log_interval == 0


def _scalars_missing_on_disk(step: int) -> bool:
    """Due for `step` and in no event file of --tensorboard-dir (a new process's view)."""
    from megatron import get_args

    return _scalars_due(step) and not _on_disk(Path(get_args().tensorboard_dir), step)


def _on_disk(folder: Path, step: int) -> bool:
    """Some event file in `folder` holds a scalar of training step `step` (a loss)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.step == step and any(v.tag.endswith("loss") for v in event.summary.value):
                return True
    return False


def decide(step: int, everyone: List[Dict[str, Any]], log_interval: int
           ) -> Optional[Dict[str, Any]]:
    """What every rank does for `step` (pure, the same on every rank): None (nothing), or
    {"record": the values to log, "print": bool, "scalars": bool}."""
    last_rank = len(everyone) - 1
    mine = [e.get("step_log") or {} for e in everyone]
    records = [r if r is not None and r["iteration"] == step else None
               for r in (m.get("record") for m in mine)]
    printer = mine[last_rank]
    if printer.get("survivor"):
        rec = records[last_rank]
        printed = rec is not None and rec["passed"]
    else:  # its barrier and the print need every rank: did every survivor get past it?
        printed = all(r is not None and r["passed"] for r, m in zip(records, mine)
                      if m.get("survivor"))
    need_print = step % log_interval == 0 and not printed
    need_scalars = bool(printer.get("scalars_missing"))
    if not (need_print or need_scalars):
        return None
    source = records[last_rank] or next((r for r in records if r and r["last_stage"]), None)
    if source is None:
        return None
    return {"record": source, "print": need_print, "scalars": need_scalars}


def replay(training_log: Callable[..., Any], plan: Dict[str, Any], last_rank: bool,
           model: Any, optimizer: Any, when: str = "recovery",
           why: str = "lost with the fault") -> None:
    """Call Megatron's own `training_log` for the kept step again, on every rank. What a
    record kept by step_losses lacks is what train() would pass, read as it would read it: the
    learning rate and loss scale from the optimizer (rolled back to the step), the parameter
    norm from the model (rebuilt at the step)."""
    import torch
    from megatron import get_args, get_timers
    from megatron import global_vars as gv
    from megatron.utils import calc_params_l2_norm

    rec = dict(plan["record"])
    if rec["learning_rate"] is None:
        rec["learning_rate"] = optimizer.param_groups[0]["lr"]
    if rec["loss_scale"] is None:
        rec["loss_scale"] = optimizer.get_loss_scale().item()
    if not rec["called"] and get_args().log_params_norm:
        rec["params_norm"] = calc_params_l2_norm(model)  # a collective: every rank runs it
    cuda = torch.cuda.FloatTensor
    loss_dict = {k: cuda([v])[0] for k, v in rec["loss_dict"].items()}
    total = {k: (cuda([v]) if isinstance(v, float) else v)
             for k, v in rec["total_loss_dict"].items()}
    get_timers()("interval-time", log_level=0)  # as train() creates it (not started: 0.0 ms)
    writer = gv._GLOBAL_TENSORBOARD_WRITER
    if last_rank and not plan["scalars"]:
        gv._GLOBAL_TENSORBOARD_WRITER = None
    quiet = contextlib.redirect_stdout(io.StringIO()) if last_rank and not plan["print"] \
        else contextlib.nullcontext()
    try:
        with quiet:
            getattr(training_log, "__wrapped__", training_log)(
                loss_dict, total, rec["learning_rate"], rec["iteration"], rec["loss_scale"],
                False, rec["skipped_iter"], rec["grad_norm"], rec["params_norm"],
                rec["num_zeros_in_grad"])
    finally:
        gv._GLOBAL_TENSORBOARD_WRITER = writer
    if last_rank:
        _flush_writer()
        what = " and ".join(w for w, on in (("log line", plan["print"]),
                                            ("scalars", plan["scalars"])) if on)
        if what:
            log.warning("%s: step %d's %s written again (%s)", when, rec["iteration"], what,
                        why)


# -- the dying checkpoint --------------------------------------------------------------------------
def for_checkpoint(step: int) -> Optional[Dict[str, Any]]:
    """This rank's record of `step` for the dying checkpoint (tensors by reference: the writer
    reads them), or None: no record of the step from `training_log` (a record kept by
    `step_losses` lacks the learning rate and loss scale of the step, which a loaded run can
    no longer read), or not of the last stage (no losses)."""
    rec = _last
    if rec is None or rec.iteration != step or not rec.called or not rec.last_stage:
        return None
    return {f.name: getattr(rec, f.name) for f in fields(rec)}


_NUMBER = (int, float)


def from_checkpoint(state: Any, step: int) -> Dict[str, Any]:
    """The record read from a checkpoint of `step` (torch.load, weights_only), every field
    checked and made plain; raises ValueError naming the first field that is wrong."""
    if not isinstance(state, dict) or set(state) != {f.name for f in fields(LogRecord)}:
        raise ValueError("not a step log record")
    rec = dict(state)
    for name in ("loss_dict", "total_loss_dict"):
        d = rec[name]
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise ValueError(f"{name} is not a dict of names")
        rec[name] = {k: _checked_number(v, f"{name}[{k!r}]") for k, v in d.items()}
    for name in ("learning_rate", "loss_scale"):
        rec[name] = _checked_number(rec[name], name)
    for name in ("grad_norm", "params_norm", "num_zeros_in_grad"):
        rec[name] = None if rec[name] is None else _checked_number(rec[name], name)
    for name in ("iteration", "skipped_iter"):
        if type(rec[name]) is not int:
            raise ValueError(f"{name} is not an int")
    for name in ("passed", "last_stage", "called"):
        if type(rec[name]) is not bool:
            raise ValueError(f"{name} is not a bool")
    if rec["iteration"] != step or not rec["called"] or not rec["last_stage"]:
        raise ValueError(f"a record of step {rec['iteration']}, not of the step saved ({step})")
    return rec


def _checked_number(value: Any, name: str) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} is a tensor of {value.numel()} elements, not one")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        raise ValueError(f"{name} is not a number")
    return value


def after_load(rec: Dict[str, Any], last_rank: bool, model: Any, optimizer: Any) -> None:
    """Every rank, after loading the dying checkpoint of `rec`'s step (whose record every rank
    read): call `training_log` for it once more when its line was not printed or its scalars
    are missing (the last rank's writer says which)."""
    from megatron import training

    plan = {"record": rec, "print": _line_missing(rec),
            "scalars": last_rank and _scalars_missing_on_disk(rec["iteration"])}
    replay(training.training_log, plan, last_rank, model, optimizer, when="resume",
           why="lost with the fault that ended the run that saved it")


def wanted_after_load(rec: Dict[str, Any]) -> bool:
    """Whether the ranks replay `rec` at all (the same answer on every rank: from the record
    and the arguments only)."""
    from megatron import get_args

    args = get_args()
    return _line_missing(rec) or bool(
        args.tensorboard_dir and rec["iteration"] % args.tensorboard_log_interval == 0)


def _line_missing(rec: Dict[str, Any]) -> bool:
    """A step Megatron logs whose record says its barrier, hence its print, was not passed."""
    from megatron import get_args

    return rec["iteration"] % get_args().log_interval == 0 and not rec["passed"]
