"""CPU stand-ins for the parts of NVIDIA apex (and its ``amp_C`` extension) Megatron imports.

Registered in ``sys.modules`` as ``apex``, ``apex.optimizers``, ``apex.multi_tensor_apply`` and
``amp_C``. Signatures follow apex's own, so code written against apex works unchanged.

* ``apex.optimizers.FusedAdam`` / ``FusedSGD``: ``optimizer/__init__.py:3-4``. FusedAdam's
  default ``adam_w_mode=True`` is AdamW (decoupled weight decay); ``adam_w_mode=False`` is Adam
  with L2. Built on ``torch.optim.Adam`` / ``SGD`` with ``foreach=False`` (per-tensor loop,
  deterministic). State keys (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) are the ones
  Megatron's optimizer wrappers and checkpoints read.
* ``apex.multi_tensor_apply.multi_tensor_applier``: ``optimizer/optimizer.py:7,47``,
  ``optimizer/clip_grads.py:8,75,101``, ``utils.py:10,55``.
* ``amp_C.multi_tensor_l2norm`` / ``multi_tensor_scale``: ``optimizer/optimizer.py:8,47``,
  ``optimizer/clip_grads.py:9,75,101``, ``utils.py:11,55``. Both raise the overflow flag
  (``noop_flag`` set to 1) on non-finite values, as the CUDA kernels do.
* ``apex.contrib`` is deliberately absent: ``model/fused_layer_norm.py:15-19`` then sets
  ``HAVE_PERSIST_LAYER_NORM = False``.
"""

from __future__ import annotations

import types
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from mindio_ttp.compat import features
from mindio_ttp.compat.journal import Journal

#: apex's default chunk size; kept so callers that read it see the same number.
CHUNK_SIZE = 2048 * 32


class FusedAdam(torch.optim.Adam):
    """apex ``FusedAdam`` on top of ``torch.optim.Adam``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as in apex)")
        if not bias_correction:
            raise NotImplementedError(
                "FusedAdam(bias_correction=False) has no CPU stand-in in mindio_ttp.cpu_adaptor"
            )
        # torch.optim.Adam takes decoupled_weight_decay only in recent releases (2.13 does,
        # 2.1.2 does not); where it does not, step() decays the params itself, as AdamW does.
        has_flag = features.adam_has_decoupled_weight_decay()
        self._decay_by_hand = adam_w_mode and not has_flag
        extra = {"decoupled_weight_decay": adam_w_mode} if has_flag else {}
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False, **extra)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def __getstate__(self) -> Dict[str, Any]:
        # torch's Optimizer pickles (and copy.copy copies) only defaults/state/param_groups;
        # ReplicatedOptimizer's partner stripe is such a copy, and must keep apex's options.
        return {**super().__getstate__(),
                **{k: self.__dict__[k] for k in ("adam_w_mode", "set_grad_none",
                                                  "_decay_by_hand")}}

    def step(self, closure: Any = None) -> Any:
        if not self._decay_by_hand:
            return super().step(closure)
        decays = [group["weight_decay"] for group in self.param_groups]
        with torch.no_grad():  # torch's AdamW: param *= 1 - lr * wd, then the Adam update
            for group, wd in zip(self.param_groups, decays):
                for param in group["params"]:
                    if wd and param.grad is not None:
                        param.mul_(1 - group["lr"] * wd)
                group["weight_decay"] = 0.0
        try:
            return super().step(closure)
        finally:
            for group, wd in zip(self.param_groups, decays):
                group["weight_decay"] = wd

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class FusedSGD(torch.optim.SGD):
    """apex ``FusedSGD`` on top of ``torch.optim.SGD``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
    ) -> None:
        if wd_after_momentum:
            raise NotImplementedError(
                "FusedSGD(wd_after_momentum=True) has no CPU stand-in in mindio_ttp.cpu_adaptor"
            )
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, foreach=False)
        self.set_grad_none = set_grad_none

    def __getstate__(self) -> Dict[str, Any]:
        return {**super().__getstate__(), "set_grad_none": self.set_grad_none}

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class MultiTensorApply:
    """apex's ``multi_tensor_applier``: calls ``op(chunk_size, noop_flag, tensor_lists, *args)``."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def __call__(self, op: Any, noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[List[torch.Tensor]], *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(CHUNK_SIZE)


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[List[torch.Tensor]],
    per_tensor: Optional[bool] = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """L2 norm over all tensors of ``tensor_lists[0]``, accumulated in fp32.

    Returns ``(total, per_tensor_norms)``; total has shape ``[1]``; per_tensor_norms is empty
    unless ``per_tensor``. Sets ``noop_flag`` to 1 when the norm is not finite.
    """
    tensors = tensor_lists[0]
    if tensors:
        norms = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float32)
                             for t in tensors])
        total = torch.linalg.vector_norm(norms).reshape(1)
    else:
        norms = torch.zeros(0, dtype=torch.float32)
        total = torch.zeros(1, dtype=torch.float32)
    if not bool(torch.isfinite(total).all()):
        noop_flag.fill_(1)
    return total, norms if per_tensor else torch.zeros(0, dtype=torch.float32)


def multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[List[torch.Tensor]],
    scale: float,
) -> None:
    """``dst = src * scale`` for each pair (computed in fp32, stored in dst's dtype).

    Sets ``noop_flag`` to 1 when any source value is not finite (apex checks the inputs).
    """
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        src32 = src.detach().float()
        if not bool(torch.isfinite(src32).all()):
            noop_flag.fill_(1)
        dst.copy_(src32 * scale)


def _module(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    mod.__dict__.update(attrs)
    return mod


def install(journal: Journal) -> None:
    """Register the stand-in modules."""
    optimizers = _module("apex.optimizers", "FusedAdam/FusedSGD stand-ins (mindio_ttp)",
                         FusedAdam=FusedAdam, FusedSGD=FusedSGD)
    mta = _module("apex.multi_tensor_apply", "multi_tensor_applier stand-in (mindio_ttp)",
                  MultiTensorApply=MultiTensorApply, multi_tensor_applier=multi_tensor_applier)
    apex = _module("apex", "CPU stand-in for NVIDIA apex, installed by mindio_ttp.cpu_adaptor",
                   optimizers=optimizers, multi_tensor_apply=mta)
    amp_c = _module("amp_C", "CPU stand-in for apex's amp_C, installed by mindio_ttp.cpu_adaptor",
                    multi_tensor_l2norm=multi_tensor_l2norm,
                    multi_tensor_scale=multi_tensor_scale)
    for mod in (apex, optimizers, mta, amp_c):
        journal.add_module(mod)
