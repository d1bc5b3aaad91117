"""Test-only: Megatron's Adam replaced by an optimizer that keeps `step` in its param groups,
as apex FusedAdam does (no per-parameter step), so a wrong group step after a resume changes
the bias correction and shows as a different loss.

Put this folder first on PYTHONPATH with ``TTP_TEST_GROUP_STEP_ADAM=1``; the fault injector of
``../fault_hook`` still runs (this file executes it first).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _group_step_adam():
    import torch

    class GroupStepAdam(torch.optim.Optimizer):
        """Adam (L2 weight decay, like Megatron's default FusedAdam use) whose step count
        lives in each param group."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                t, (b1, b2) = group["step"], group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    grad = p.grad.add(p, alpha=group["weight_decay"])
                    state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                    state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))

    return GroupStepAdam


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron.optimizer":
            return None
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            module.Adam = _group_step_adam()

        spec.loader.exec_module = exec_module
        return spec


def _run_fault_hook() -> None:
    spec = importlib.util.spec_from_file_location(
        "ttp_fault_hook", _HERE.parent / "fault_hook" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_fault_hook()
if os.environ.get("TTP_TEST_GROUP_STEP_ADAM") == "1":
    sys.meta_path.insert(0, _Finder())
