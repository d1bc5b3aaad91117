"""Test-only profile of one training step of a real Megatron worker, stock or patched (no tree
edits): where the step's time goes, per iteration, per rank.

Put this folder first on PYTHONPATH and set ``TTP_STEP_PROFILE_DIR``: every rank appends one
JSON line per ``train_step`` to ``<dir>/rank-<rank>.jsonl``: ``{"iteration": i, "step": s,
"sections": {name: seconds}}``, wall-clock (``time.perf_counter``) of each section, summed
over the calls inside that step. A section nested in another is counted in both (a method
that calls its parent class's method of the same name is counted once). Sections:

* ``forward-backward``: the schedule's forward and backward passes;
* ``reduce_model_grads``, ``step``, ``gather_model_params``: the optimizer's three calls in
  train_step (stock DistributedOptimizer's, or ReplicatedOptimizer's overrides);
* inside them: ``grads reduce-scatter`` (stock's part of reduce_model_grads),
  ``stripe swap`` (ReplicatedOptimizer's start of the swap and its wait for it),
  ``grad norm (beside the swap)`` (the norm and its all-reduce, run while the swap is in
  flight, between the two), ``copy grads to main``, ``clip grad norm`` (with the overlap:
  only the clip), ``own update`` and ``partner update`` (each stripe's inner optimizer
  step), ``copy main to params``, ``increase_step`` (the step record);
* ``barrier``: torch.distributed.barrier called inside train_step (the guide's);
* the hooks: ``ttp_start_updating_os``, ``ttp_end_updating_os``, ``ttp_offer_update``, and
  ``ttp_set_ckpt_args`` (called by the loop after train_step: recorded with the next step);
* CPU time (not wall): ``cpu: this thread, in the step`` (the training thread),
  ``cpu: other threads, in the step`` and ``... between steps`` (gloo's threads, and the
  runtime's: heartbeats, the processor), from ``time.thread_time`` and ``process_time``.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path

from testkit.import_hooks import after_import

_local = threading.local()
_state: dict = {"file": None, "iteration": 0}


def _sections() -> dict:
    if not hasattr(_local, "sections"):
        _local.sections = {}
        _local.active = set()
    return _local.sections


def _timed(name, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        sections = _sections()
        if name in _local.active:  # a subclass calling its parent's method of the same name
            return fn(*args, **kwargs)
        _local.active.add(name)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sections[name] = sections.get(name, 0.0) + time.perf_counter() - t0
            _local.active.discard(name)

    return timed


def _write(record: dict) -> None:
    import torch

    if _state["file"] is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
        path = Path(os.environ["TTP_STEP_PROFILE_DIR"]) / f"rank-{rank}.jsonl"
        _state["file"] = open(path, "a", buffering=1)
    _state["file"].write(json.dumps(record) + "\n")


def _install_training(training) -> None:
    import torch

    real_step = training.train_step
    real_barrier = torch.distributed.barrier
    real_get_fb = training.get_forward_backward_func

    def barrier(*args, **kwargs):
        if getattr(_local, "in_step", False):
            return _timed("barrier", real_barrier)(*args, **kwargs)
        return real_barrier(*args, **kwargs)

    torch.distributed.barrier = barrier
    training.get_forward_backward_func = lambda *a, **k: _timed("forward-backward",
                                                                real_get_fb(*a, **k))

    @functools.wraps(real_step)
    def train_step(*args, **kwargs):
        sections = _sections()
        _local.in_step = True
        now = (time.perf_counter(), time.process_time(), time.thread_time())
        # the CPU the process used since the previous step ended, outside this thread: gloo's
        # and the runtime's threads between steps too (heartbeats, the processor)
        between = now[1] - now[2] - _state.get("other_cpu_at", now[1] - now[2])
        try:
            return real_step(*args, **kwargs)
        finally:
            end = (time.perf_counter(), time.process_time(), time.thread_time())
            _local.in_step = False
            _state["iteration"] += 1
            sections["cpu: this thread, in the step"] = end[2] - now[2]
            sections["cpu: other threads, in the step"] = (end[1] - end[2]) - (now[1] - now[2])
            sections["cpu: other threads, between steps"] = between
            _state["other_cpu_at"] = end[1] - end[2]
            _write({"iteration": _state["iteration"], "step": end[0] - now[0],
                    "sections": dict(sections)})
            sections.clear()

    training.train_step = train_step
    _install_optimizers()
    _install_hooks()


def _install_optimizers() -> None:
    from megatron.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.optimizer.optimizer import MegatronOptimizer, MixedPrecisionOptimizer

    names = {"reduce_model_grads": "reduce_model_grads", "step": "step",
             "gather_model_params": "gather_model_params",
             "_copy_model_grads_to_main_grads": "copy grads to main",
             "_copy_main_params_to_model_params": "copy main to params",
             "clip_grad_norm": "clip grad norm"}
    classes = [MegatronOptimizer, MixedPrecisionOptimizer, DistributedOptimizer]
    try:
        from mindio_ttp.megatron_ttp.replicated_optimizer import ReplicatedOptimizer

        classes.append(ReplicatedOptimizer)
        ReplicatedOptimizer._start_swap = _timed("stripe swap", ReplicatedOptimizer._start_swap)
        ReplicatedOptimizer._finish_swap = _timed("stripe swap",
                                                  ReplicatedOptimizer._finish_swap)
        ReplicatedOptimizer._grad_norm = _timed("grad norm (beside the swap)",
                                                ReplicatedOptimizer._grad_norm)
        ReplicatedOptimizer.increase_step = _timed("increase_step",
                                                   ReplicatedOptimizer.increase_step)
        real_init = ReplicatedOptimizer.__init__

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            for stripe, label in ((self.own, "own update"), (self.partner, "partner update")):
                inner = stripe.optimizer
                if not getattr(inner, "_ttp_profiled", False):
                    inner.step = _timed(label, inner.step)
                    inner._ttp_profiled = True

        ReplicatedOptimizer.__init__ = init
    except ImportError:  # a stock worker without the package importable: stock sections only
        pass
    # stock's own reduce (reduce-scatter and the layer-norm / embedding all-reduces), also when
    # ReplicatedOptimizer's override calls it
    DistributedOptimizer.reduce_model_grads = _timed(
        "grads reduce-scatter", DistributedOptimizer.reduce_model_grads)
    for cls in classes:
        for attr, label in names.items():
            if attr in cls.__dict__:
                setattr(cls, attr, _timed(label, cls.__dict__[attr]))
    _install_stock_inner(DistributedOptimizer)


def _install_stock_inner(DistributedOptimizer) -> None:
    """Stock's inner optimizer step ("own update") and its reduce-scatter, by wrapping the
    instance after construction (stock has one stripe: its own)."""
    real_init = DistributedOptimizer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        inner = self.optimizer
        if not getattr(inner, "_ttp_profiled", False):
            inner.step = _timed("own update", inner.step)
            inner._ttp_profiled = True

    DistributedOptimizer.__init__ = init


def _install_hooks() -> None:
    try:
        import mindio_ttp.framework_ttp as ttp
    except ImportError:
        return
    for name in ("ttp_start_updating_os", "ttp_end_updating_os", "ttp_offer_update",
                 "ttp_set_ckpt_args"):
        setattr(ttp, name, _timed(name, getattr(ttp, name)))


def _install() -> None:
    if not os.environ.get("TTP_STEP_PROFILE_DIR"):
        return
    after_import("megatron.training", _install_training)


_install()
