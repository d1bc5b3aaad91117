"""CPU stand-ins for Megatron's layer-norm extensions.

At 285068c ``model/fused_layer_norm.py:65`` imports ``fused_mix_prec_layer_norm_cuda`` by name
(``importlib.import_module``) and ``:35,48`` call ``forward_affine`` / ``backward_affine``.
ATen's ``native_layer_norm`` returns ``(output, mean, rstd)`` like the CUDA kernel's
``(output, mean, invvar)``, and its backward takes them back, so the autograd function in
Megatron runs unchanged. ``rstd`` is the inverse standard deviation, i.e. exactly what the
kernel calls ``invvar``. From 2023-04 on (e.g. e48626bb6e) the same file imports apex's
``FusedLayerNormAffineFunction`` instead and the extension ``fused_layer_norm_cuda``: the
function below is that autograd function on the same ATen ops (``apex_standins`` registers it
as ``apex.normalization.fused_layer_norm``), and the extension is registered under both names.
"""

from __future__ import annotations

import types
from typing import List, Optional, Sequence, Tuple

import torch

from mindio_ttp.compat.journal import Journal

MODULE_NAME = "fused_mix_prec_layer_norm_cuda"
APEX_MODULE_NAME = "fused_layer_norm_cuda"  # the name apex's own extension has


def _shape(normalized_shape: Sequence[int]) -> List[int]:
    return [int(n) for n in normalized_shape]


def forward_affine(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor,
                   bias: torch.Tensor, eps: float
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer norm with weight and bias: ``(output, mean, invvar)``."""
    return torch.ops.aten.native_layer_norm(input, _shape(normalized_shape), weight, bias, eps)


def backward_affine(grad_output: torch.Tensor, mean: torch.Tensor, invvar: torch.Tensor,
                    input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor,
                    bias: torch.Tensor, eps: float
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` from the saved mean / invvar."""
    return torch.ops.aten.native_layer_norm_backward(
        grad_output, input, _shape(normalized_shape), mean, invvar, weight, bias,
        [True, True, True])


def forward(input: torch.Tensor, normalized_shape: Sequence[int], eps: float
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer norm without affine parameters: ``(output, mean, invvar)``."""
    return torch.ops.aten.native_layer_norm(input, _shape(normalized_shape), None, None, eps)


def backward(grad_output: torch.Tensor, mean: torch.Tensor, invvar: torch.Tensor,
             input: torch.Tensor, normalized_shape: Sequence[int], eps: float
             ) -> torch.Tensor:
    """``grad_input`` for :func:`forward`."""
    none: Optional[torch.Tensor] = None
    grad_input, _, _ = torch.ops.aten.native_layer_norm_backward(
        grad_output, input, _shape(normalized_shape), mean, invvar, none, none,
        [True, False, False])
    return grad_input


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """apex's ``FusedLayerNormAffineFunction`` (``apply(input, weight, bias, normalized_shape,
    eps)``), on :func:`forward_affine` / :func:`backward_affine`."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):  # type: ignore[override]
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        input_, weight_, bias_ = input.contiguous(), weight.contiguous(), bias.contiguous()
        output, mean, invvar = forward_affine(input_, normalized_shape, weight_, bias_, eps)
        ctx.save_for_backward(input_, weight_, bias_, mean, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        input_, weight_, bias_, mean, invvar = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = backward_affine(
            grad_output.contiguous(), mean, invvar, input_, ctx.normalized_shape, weight_, bias_,
            ctx.eps)
        return grad_input, grad_weight, grad_bias, None, None


def install(journal: Journal) -> None:
    """Register the stand-in module under the extensions' names."""
    for name in (MODULE_NAME, APEX_MODULE_NAME):
        mod = types.ModuleType(name, __doc__)
        for fn in (forward_affine, backward_affine, forward, backward):
            setattr(mod, fn.__name__, fn)
        journal.add_module(mod)
