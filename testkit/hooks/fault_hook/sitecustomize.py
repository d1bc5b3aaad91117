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
  in a collective, the update window, the logging, or already in iteration k+1.

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


def _fired(record_dir, rank, step, phase) -> bool:
    """This planned fault already fired in this job (the record FaultPlan.check writes)."""
    import json

    if record_dir is None:
        return False
    try:
        record = json.loads((record_dir / f"fault-{rank}.json").read_text())
    except (OSError, ValueError):
        return False
    return record.get("step") == step and record.get("phase") == phase.value


class _Once:
    """The plan, each fault firing at most once per job (see the module doc)."""

    def __init__(self, plan) -> None:
        self._plan = plan

    def has(self, rank, step, phase, record_dir=None) -> bool:
        return self._plan.has(rank, step, phase) and not _fired(record_dir, rank, step, phase)

    def check(self, rank, step, phase, record_dir) -> None:
        if not _fired(record_dir, rank, step, phase):
            self._plan.check(rank, step, phase, record_dir)


def _wrap_train_step(train_step, get_args, plan, record_dir, steps_dir=None):
    import json
    import random
    import threading
    import time

    import torch

    from mindio_ttp.demo.faults import Phase

    plan = _Once(plan)

    started = []  # monotonic start of every iteration this process ran

    def fault_injecting_train_step(forward_step_func, data_iterator, model, optimizer,
                                   opt_param_scheduler):
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
            out = train_step(forward_step, data_iterator, model, optimizer, opt_param_scheduler)
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


def _install() -> None:
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
    plan, record_dir = FaultPlan.from_text(text), Path(record) if record else None

    def wrap(module) -> None:
        module.train_step = _wrap_train_step(module.train_step, module.get_args, plan, record_dir,
                                             Path(steps) if steps else None)

    after_import(TARGET, wrap)


_install()
