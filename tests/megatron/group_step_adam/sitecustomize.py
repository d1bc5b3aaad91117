"""Test-only: Megatron's Adam replaced by an optimizer that keeps `step` in its param groups,
as apex FusedAdam does (no per-parameter step), so a wrong group step after a resume changes
the bias correction and shows as a different loss.

Put this folder first on PYTHONPATH with ``TTP_TEST_GROUP_STEP_ADAM=1``; the fault injector of
``testkit/hooks/fault_hook`` still runs (this file executes it first).
"""

from __future__ import annotations

import os
from pathlib import Path

from testkit.hooks import FAULT_HOOK_DIR
from testkit.import_hooks import after_import, run_hook_file

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


run_hook_file(str(FAULT_HOOK_DIR / "sitecustomize.py"))
if os.environ.get("TTP_TEST_GROUP_STEP_ADAM") == "1":
    after_import("megatron.optimizer", lambda module: setattr(module, "Adam", _group_step_adam()))
