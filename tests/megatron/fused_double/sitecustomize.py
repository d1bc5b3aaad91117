"""Test-only: Megatron's Adam replaced by a double of a fused optimizer that keeps per-instance
buffer lists the way torch_npu's ``NpuFusedOptimizerBase`` does: a list made in ``__init__``
(``params_all_group_combined = 2 * [None]`` there), filled *by index* at the first step with the
combined parameters, and used by every later step. A shallow copy of such an optimizer shares
the list, so whichever copy steps last owns it, and the other then updates the wrong params.

Put this folder first on PYTHONPATH with ``TTP_TEST_FUSED_DOUBLE=1``; the fault injector of
``testkit/hooks/fault_hook`` still runs (this file executes it first).
"""

from __future__ import annotations

import os

from testkit.hooks import FAULT_HOOK_DIR
from testkit.import_hooks import after_import, run_hook_file


def _fused_double():
    import torch

    class FusedAdamDouble(torch.optim.Optimizer):
        """AdamW over the params combined at the first step (module doc)."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay))
            self.params_all_group_combined = [None]  # filled by index at the first step
            self.is_params_grads_combined = False

        def _maybe_init_combined(self):
            if self.is_params_grads_combined:
                return
            self.params_all_group_combined[0] = [
                (index, p) for index, group in enumerate(self.param_groups)
                for p in group["params"]]
            self.is_params_grads_combined = True

        @torch.no_grad()
        def step(self, closure=None):
            self._maybe_init_combined()
            for index, p in self.params_all_group_combined[0]:
                if p.grad is None:
                    continue
                group = self.param_groups[index]
                (b1, b2), state = group["betas"], self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))

    return FusedAdamDouble


run_hook_file(str(FAULT_HOOK_DIR / "sitecustomize.py"))
if os.environ.get("TTP_TEST_FUSED_DOUBLE") == "1":
    after_import("megatron.optimizer", lambda module: setattr(module, "Adam", _fused_double()))
