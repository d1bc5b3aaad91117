"""CPU stand-in for Megatron's ``fused_mix_prec_layer_norm_cuda`` extension.

``model/fused_layer_norm.py:65`` imports it by name (``importlib.import_module``) and
``:35,48`` call ``forward_affine`` / ``backward_affine``. ATen's ``native_layer_norm`` returns
``(output, mean, rstd)`` like the CUDA kernel's ``(output, mean, invvar)``, and its backward
takes them back, so the autograd function in Megatron runs unchanged. ``rstd`` is the inverse
standard deviation, i.e. exactly what the kernel calls ``invvar``.
"""

from __future__ import annotations

import types
from typing import List, Optional, Sequence, Tuple

import torch

from mindio_ttp.compat.journal import Journal

MODULE_NAME = "fused_mix_prec_layer_norm_cuda"


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


def install(journal: Journal) -> None:
    """Register the stand-in module under the extension's name."""
    mod = types.ModuleType(MODULE_NAME, __doc__)
    for fn in (forward_affine, backward_affine, forward, backward):
        setattr(mod, fn.__name__, fn)
    journal.add_module(mod)
