"""Test-only fault injection into real Megatron-LM, without editing the tree beyond the patch.

Put this folder on PYTHONPATH and set ``TTP_FAULT_PLAN`` (the text form of
``mindio_ttp.demo.faults.FaultPlan``, e.g. ``1:5:sigkill:before``). Python imports
``sitecustomize`` at start-up in every process; this one wraps ``megatron.training.train_step``
right after that module is imported, so iteration k (1-based, Megatron's printed number) fires:

* ``before``: in the forward step of iteration k (first micro-batch), before any gradient
  exchange: the survivors last finished step k-1;
* ``barrier``: right after the guide's barrier (the first ``torch.distributed.barrier`` after
  ``reduce_model_grads``), before ``ttp_start_updating_os``;
* ``inside``: after the optimizer step of iteration k, still inside the update window;
* ``after``: after ``ttp_end_updating_os(k)``, before the parameter all-gather;
* ``anytime``: a timer armed when iteration k starts fires after a random delay, uniform in
  [0, the wall time of iteration k-1) (``TTP_FAULT_SEED`` seeds it), wherever the rank then is:
  in a collective, the update window, the logging, or already in iteration k+1;
* ``eval``: in the first forward step of the evaluation after iteration k;
* ``periodic-save``: inside Megatron's periodic save of iteration k, once this rank wrote its
  first file;
* ``refill``: on a rank of an in-memory recovery to step k, as it starts refilling;
* ``replacement``: in the process ttprun starts to replace rank r in a recovery to step k,
  first thing (before torch is imported): ``sigkill`` for a replacement that fails to start,
  ``sigstop`` for one that never gets ready;
* ``save``: inside the dying checkpoint of step k, after the first write of the rank's first
  file (``checkpoint_writer.write_torch``): the rank dies (or throws) half-way through a file.
* the windows outside the training loop (k = 1 before the first step, else the last
  iteration): ``startup`` once ``initialize_megatron`` returned, ``model`` once ``get_model``
  returned, ``load`` as the checkpoint load starts (not a recovery's refill), ``final-eval`` in
  the first forward step of pretrain's evaluation after train(), ``final-save`` inside
  pretrain's final save once this rank wrote its first file, ``exit`` right after that save
  completed on every rank (``mega.final_checkpoint_saved``).
* ``log``: as ``training_log`` of iteration k starts (after its update, before its scalars and
  the barrier before the printed line).

``TTP_FAULT_CORRUPT_REFILL=R`` (no plan needed) changes one value of what replacement rank R
received in its refill, as a bad link or a bug would: the recovery's hash check must refuse it.

``TTP_FAULT_RECORD_DIR`` (optional) is where the plan records the fault time and coordinates
ranks killed together. With it, a planned fault fires once per job: after an in-memory
recovery, the replacement of a killed rank (same plan, same rank) redoes the step the fault
hit without firing it again, and later faults of the plan still fire (``1:5:sigkill:before,
2:6:sigkill:before`` kills rank 1 at step 5, then, right after the recovery, rank 2 at step 6).

``TTP_STEP_RECORD_DIR`` (optional, also without a plan): every rank appends one JSON line per
completed iteration to ``steps-<rank>.jsonl`` there (step, wall-clock start and end, pid,
attempt), so a benchmark can tell when a step completed on every rank.

Under ``ttprun --max-restarts``, ``|`` separates the plans of successive attempts
(``1:3:sigkill:before|2:6:sigkill:inside``: attempt 0 kills rank 1, the restarted attempt 1
kills rank 2, later attempts run clean); the attempt is torch's TORCHELASTIC_RESTART_COUNT.
"""

from __future__ import annotations

import os

TARGET = "megatron.training"


def _marker(record_dir, rank, step, phase):
    return record_dir / f"fired-{rank}-{step}-{phase.value}"


def _fired(record_dir, rank, step, phase) -> bool:
    """This planned fault already fired in this job."""
    return record_dir is not None and _marker(record_dir, rank, step, phase).exists()


class _Once:
    """The plan, each fault firing at most once per job (see the module doc): a marker file per
    fault in the record directory, written just before it fires."""

    def __init__(self, plan) -> None:
        self._plan = plan

    def has(self, rank, step, phase, record_dir=None) -> bool:
        return self._plan.has(rank, step, phase) and not _fired(record_dir, rank, step, phase)

    def check(self, rank, step, phase, record_dir) -> None:
        if not self._plan.has(rank, step, phase) or _fired(record_dir, rank, step, phase):
            return
        if record_dir is not None:
            _marker(record_dir, rank, step, phase).touch()
        self._plan.check(rank, step, phase, record_dir)


def _wrap_train_step(train_step, get_args, plan, record_dir, steps_dir=None):
    import json
    import random
    import threading
    import time

    import torch

    from mindio_ttp.demo.faults import Phase

    started = []  # monotonic start of every iteration this process ran

    def fault_injecting_train_step(forward_step_func, data_iterator, model, optimizer,
                                   opt_param_scheduler, *rest, **kwargs):
        # *rest: later Megatron passes more (2023-05: the model config)
        step = get_args().curr_iteration + 1
        rank = torch.distributed.get_rank()
        fired = []
        started.append(time.monotonic())
        started_at = time.time()
        if plan.has(rank, step, Phase.ANYTIME, record_dir) and len(started) >= 2:
            rng = random.Random(f"{os.environ.get('TTP_FAULT_SEED', '0')}:{rank}:{step}")
            delay = rng.uniform(0.0, started[-1] - started[-2])
            print(f"rank {rank} | fault timer: {delay:.3f} s into iteration {step}", flush=True)
            timer = threading.Timer(delay, plan.check, (rank, step, Phase.ANYTIME, record_dir))
            timer.daemon = True
            timer.start()

        def forward_step(*args, **kwargs):
            if not fired:
                fired.append(True)
                plan.check(rank, step, Phase.BEFORE, record_dir)
            return forward_step_func(*args, **kwargs)

        cls = type(optimizer)

        def opt_step(args, timers):
            out = cls.step(optimizer, args, timers)
            plan.check(rank, step, Phase.INSIDE, record_dir)
            return out

        def gather(args, timers):
            plan.check(rank, step, Phase.AFTER, record_dir)
            return cls.gather_model_params(optimizer, args, timers)

        reduced = []

        def reduce(args, timers):
            out = cls.reduce_model_grads(optimizer, args, timers)
            reduced.append(True)
            return out

        real_barrier = torch.distributed.barrier

        def barrier(*args, **kwargs):
            out = real_barrier(*args, **kwargs)
            if reduced and len(reduced) == 1:
                reduced.append(True)  # only the guide's barrier, right after the reduce
                plan.check(rank, step, Phase.BARRIER, record_dir)
            return out

        optimizer.step, optimizer.gather_model_params = opt_step, gather
        optimizer.reduce_model_grads = reduce
        torch.distributed.barrier = barrier
        try:
            out = train_step(forward_step, data_iterator, model, optimizer, opt_param_scheduler,
                             *rest, **kwargs)
        finally:
            del optimizer.step, optimizer.gather_model_params, optimizer.reduce_model_grads
            torch.distributed.barrier = real_barrier
        if steps_dir is not None:
            line = json.dumps({"rank": rank, "step": step, "start": started_at,
                               "end": time.time(), "pid": os.getpid(),
                               "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")})
            with open(steps_dir / f"steps-{rank}.jsonl", "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return out

    return fault_injecting_train_step


def _wrap_evaluate(evaluate, get_args, plan, record_dir, trained):
    import torch

    from mindio_ttp.demo.faults import Phase

    def fault_injecting_evaluate(forward_step_func, *args, **kwargs):
        margs = get_args()  # a replacement re-running pretrain trains no step: no curr_iteration
        step = getattr(margs, "curr_iteration", margs.iteration - 1) + 1
        rank = torch.distributed.get_rank()
        fired = []
        phase = Phase.FINAL_EVAL if trained else Phase.EVAL

        def forward_step(*a, **kw):
            if not fired:
                fired.append(True)
                plan.check(rank, step, phase, record_dir)
            return forward_step_func(*a, **kw)

        return evaluate(forward_step, *args, **kwargs)

    return fault_injecting_evaluate


def _wrap_save(save_checkpoint, plan, record_dir, trained):
    import torch

    from mindio_ttp.demo.faults import Phase

    def fault_injecting_save(iteration, *args, **kwargs):
        rank = torch.distributed.get_rank()
        phase = Phase.FINAL_SAVE if trained else Phase.PERIODIC_SAVE
        if not plan.has(rank, iteration, phase, record_dir):
            return save_checkpoint(iteration, *args, **kwargs)
        real_save = torch.save

        def save(*a, **kw):
            real_save(*a, **kw)
            plan.check(rank, iteration, phase, record_dir)

        torch.save = save
        try:
            return save_checkpoint(iteration, *args, **kwargs)
        finally:
            torch.save = real_save

    return fault_injecting_save


def _wrap_refill(load_in_memory, plan, record_dir):
    from mindio_ttp.demo.faults import Phase

    def fault_injecting_refill(model, optimizer, scheduler):
        from mindio_ttp.megatron_ttp import rejoin

        job = rejoin.current()
        if job is not None:
            plan.check(job.rank, job.order.step, Phase.REFILL, record_dir)
        return load_in_memory(model, optimizer, scheduler)

    return fault_injecting_refill


def _replacement_fault(plan, record_dir) -> None:
    """In a replacement process (the launcher set TTP_RECOVERY_JOIN), first thing."""
    import json

    from mindio_ttp.demo.faults import Phase

    text = os.environ.get("TTP_RECOVERY_JOIN")
    if text:
        join = json.loads(text)
        plan.check(int(join["rank"]), int(join["step"]), Phase.REPLACEMENT, record_dir)


def _corrupt_refill(module) -> None:
    """After replacement rank TTP_FAULT_CORRUPT_REFILL applied what its partner sent, add
    1e-3 to the first element of its own stripe's first main param."""
    apply = module._apply
    target = int(os.environ["TTP_FAULT_CORRUPT_REFILL"])

    def corrupting_apply(payload, model, optimizer, scheduler, args):
        apply(payload, model, optimizer, scheduler, args)
        if optimizer.place.rank == target:
            main = optimizer.own.main_params()[0]
            main.data.view(-1)[0] += 1e-3
            print(f"rank {target} | FAULT: corrupted the refill", flush=True)

    module._apply = corrupting_apply


def _install() -> None:
    if os.environ.get("TTP_FAULT_CORRUPT_REFILL"):
        from testkit.import_hooks import after_import

        after_import("mindio_ttp.megatron_ttp.refill", _corrupt_refill)
    plans = os.environ.get("TTP_FAULT_PLAN", "").split("|")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    text = plans[attempt] if attempt < len(plans) else ""
    steps = os.environ.get("TTP_STEP_RECORD_DIR")
    if not text and not steps:
        return
    from pathlib import Path

    from mindio_ttp.demo.faults import FaultPlan
    from testkit.import_hooks import after_import

    record = os.environ.get("TTP_FAULT_RECORD_DIR")
    plan, record_dir = _Once(FaultPlan.from_text(text)), Path(record) if record else None
    _replacement_fault(plan, record_dir)

    trained: list = []  # non-empty once train() returned in this process (pretrain's end)

    def wrap(module) -> None:
        module.train_step = _wrap_train_step(module.train_step, module.get_args, plan, record_dir,
                                             Path(steps) if steps else None)
        module.evaluate = _wrap_evaluate(module.evaluate, module.get_args, plan, record_dir,
                                         trained)
        module.save_checkpoint = _wrap_save(module.save_checkpoint, plan, record_dir, trained)
        _wrap_windows(module, plan, record_dir, trained)

    def wrap_refill(module) -> None:
        module.load_in_memory = _wrap_refill(module.load_in_memory, plan, record_dir)

    after_import(TARGET, wrap)
    after_import("mindio_ttp.megatron_ttp.refill", wrap_refill)
    after_import("mindio_ttp.megatron_ttp.load", lambda module: _wrap_load(module, plan,
                                                                           record_dir))
    after_import("mindio_ttp.megatron_ttp.completion",
                 lambda module: _wrap_completion(module, plan, record_dir))
    after_import("mindio_ttp.faulttime.checkpoint_writer",
                 lambda module: _wrap_writer(module, plan, record_dir))


def _rank() -> int:
    import torch

    return torch.distributed.get_rank()


def _after(fn, then):
    """`fn`, running `then(result, *args)` once it returned (its attributes kept: the runtime
    reads the patch's marks on them, e.g. get_model's `_ttp_reuses_on_recovery`)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        then(out, *args)
        return out

    return wrapper


def _wrap_windows(module, plan, record_dir, trained) -> None:
    """startup, model, log, and whether train() returned (final-eval / final-save after)."""
    import functools

    from mindio_ttp.demo.faults import Phase

    module.initialize_megatron = _after(
        module.initialize_megatron, lambda *_: plan.check(_rank(), 1, Phase.STARTUP, record_dir))
    module.get_model = _after(
        module.get_model, lambda *_: plan.check(_rank(), 1, Phase.MODEL, record_dir))
    module.train = _after(module.train, lambda *_: trained.append(True))
    training_log = module.training_log

    @functools.wraps(training_log)
    def fault_injecting_training_log(*args, **kwargs):
        plan.check(_rank(), args[3], Phase.LOG, record_dir)  # args[3]: the iteration
        return training_log(*args, **kwargs)

    module.training_log = fault_injecting_training_log


def _wrap_load(module, plan, record_dir) -> None:
    from mindio_ttp.demo.faults import Phase

    real = module.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        from mindio_ttp.megatron_ttp import rejoin

        if rejoin.current() is None:
            plan.check(_rank(), 1, Phase.LOAD, record_dir)
        return real(*args, **kwargs)

    module.load_checkpoint = load_checkpoint


def _wrap_completion(module, plan, record_dir) -> None:
    from mindio_ttp.demo.faults import Phase

    module.final_checkpoint_saved = _after(
        module.final_checkpoint_saved,
        lambda _, iteration: plan.check(_rank(), iteration, Phase.EXIT, record_dir))


def _wrap_writer(module, plan, record_dir) -> None:
    """The ``save`` phase: the dying checkpoint's writer runs the plan after its first write."""
    from mindio_ttp.demo.faults import Phase
    from mindio_ttp.faulttime import save_session

    real = module.write_torch

    def write_torch(path, obj, midway=None, **kwargs):
        import torch

        session = save_session.current()
        if midway is None and session is not None and torch.distributed.is_initialized():
            rank, step = torch.distributed.get_rank(), session.step
            if plan.has(rank, step, Phase.SAVE):
                midway = lambda: plan.check(rank, step, Phase.SAVE, record_dir)  # noqa: E731
        return real(path, obj, midway, **kwargs)

    module.write_torch = write_torch


_install()
