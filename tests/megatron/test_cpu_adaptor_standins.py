"""The adaptor's stand-ins for apex, amp_C and the fused layer norm, checked against torch.

No Megatron needed: these run in CI. The stand-in modules are imported directly, without
installing the adaptor, so this process's torch stays stock.
"""

from __future__ import annotations

import math
from typing import List

import pytest
import torch

import mindio_ttp.cpu_adaptor as adaptor
from mindio_ttp.cpu_adaptor import apex_standins, layer_norm
from mindio_ttp.cpu_adaptor.apex_standins import (
    CHUNK_SIZE,
    FusedAdam,
    FusedSGD,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
)

adaptor.uninstall()  # importing the package installs it; these tests want stock torch


def _params(seed: int = 0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)),
            torch.nn.Parameter(torch.randn(7, generator=g))]


def _grads(step: int, params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _reference_adam(params, steps, lr, betas, eps, wd, decoupled):
    """apex FusedAdam's update written out (bias correction on)."""
    ps = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for t in range(1, steps + 1):
        for i, g in enumerate(_grads(t, params)):
            g = g.double()
            if not decoupled:
                g = g + wd * ps[i]
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat = m[i] / (1 - betas[0] ** t)
            v_hat = v[i] / (1 - betas[1] ** t)
            update = m_hat / (v_hat.sqrt() + eps)
            if decoupled:
                update = update + wd * ps[i]
            ps[i] = ps[i] - lr * update
    return ps


def _assert_same_steps(a, b, ours, theirs) -> None:
    """Three steps of two optimizers on equal grads leave bit-identical params."""
    for t in range(1, 4):
        for p, q, g in zip(ours, theirs, _grads(t, ours)):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fused_adam_matches_apex_update_rule(adam_w_mode: bool) -> None:
    params = _params()
    opt = FusedAdam(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    adam_w_mode=adam_w_mode)
    for t in range(1, 6):
        for p, g in zip(params, _grads(t, params)):
            p.grad = g
        opt.step()
    expected = _reference_adam(_params(), 5, 1e-2, (0.9, 0.95), 1e-8, 0.1, adam_w_mode)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)
    assert set(opt.state[params[0]]) >= {"exp_avg", "exp_avg_sq"}


def test_fused_adam_default_is_torch_adamw_bit_for_bit() -> None:
    ours, theirs = _params(), _params()
    a = FusedAdam(ours, lr=1e-3, weight_decay=0.01)
    b = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, foreach=False)
    _assert_same_steps(a, b, ours, theirs)


def test_fused_adam_refuses_what_it_cannot_do() -> None:
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(_params(), amsgrad=True)
    with pytest.raises(NotImplementedError, match="bias_correction"):
        FusedAdam(_params(), bias_correction=False)


def test_fused_adam_zero_grad_sets_none_by_default_like_apex() -> None:
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    FusedAdam(params).zero_grad()
    assert all(p.grad is None for p in params)


def test_fused_sgd_matches_torch_sgd_with_momentum() -> None:
    ours, theirs = _params(), _params()
    a = FusedSGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    b = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    _assert_same_steps(a, b, ours, theirs)
    assert "momentum_buffer" in a.state[ours[0]]


def test_multi_tensor_applier_passes_apex_chunk_size_first() -> None:
    seen = []
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(lambda *a: seen.append(a), flag, [[]], "extra")
    assert seen == [(CHUNK_SIZE, flag, [[]], "extra")]


def test_l2norm_equals_norm_of_concatenation_and_per_tensor_norms() -> None:
    tensors = [torch.randn(4, 4), torch.randn(3).half(), torch.randn(2, 2, 2).bfloat16()]
    flag = torch.zeros(1, dtype=torch.int)
    total, per = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], True)
    flat = torch.cat([t.float().flatten() for t in tensors])
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total[0], flat.norm())
    torch.testing.assert_close(per, torch.stack([t.float().norm() for t in tensors]))
    assert flag.item() == 0
    _, none = multi_tensor_applier(multi_tensor_l2norm, flag, [tensors], False)
    assert none.numel() == 0


def test_l2norm_of_no_tensors_is_zero_without_overflow() -> None:
    flag = torch.zeros(1, dtype=torch.int)
    total, _ = multi_tensor_l2norm(CHUNK_SIZE, flag, [[]], False)
    assert total.tolist() == [0.0] and flag.item() == 0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_l2norm_raises_overflow_flag_on_non_finite(bad: float) -> None:
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_l2norm(CHUNK_SIZE, flag, [[torch.ones(3), torch.tensor([1.0, bad])]], False)
    assert flag.item() == 1


def test_scale_writes_scaled_copies_in_destination_dtype() -> None:
    src = [torch.randn(5), torch.randn(2, 3)]
    dst = [torch.empty(5, dtype=torch.float16), torch.empty(2, 3)]
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 0.5)
    assert torch.equal(dst[0], (src[0] * 0.5).half())
    assert torch.equal(dst[1], src[1] * 0.5)
    assert flag.item() == 0


def test_scale_in_place_raises_overflow_flag_on_nan_input() -> None:
    grads = [torch.tensor([1.0, math.nan]), torch.ones(2)]
    flag = torch.zeros(1, dtype=torch.int)
    multi_tensor_scale(CHUNK_SIZE, flag, [grads, grads], 2.0)
    assert flag.item() == 1
    assert torch.equal(grads[1], torch.full((2,), 2.0))


class _MegatronStyleLayerNorm(torch.autograd.Function):
    """The shape of megatron/model/fused_layer_norm.py:25-55, calling the stand-in."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        out, mean, invvar = layer_norm.forward_affine(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, invvar)
        ctx.shape, ctx.eps = shape, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, invvar = ctx.saved_tensors
        gi, gw, gb = layer_norm.backward_affine(grad, mean, invvar, x, ctx.shape, weight,
                                                bias, ctx.eps)
        return gi, gw, gb, None, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_norm_forward_and_backward_match_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 16, generator=g, dtype=dtype)
    w = torch.randn(16, generator=g, dtype=dtype)
    b = torch.randn(16, generator=g, dtype=dtype)
    dy = torch.randn(4, 6, 16, generator=g, dtype=dtype)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    y = _MegatronStyleLayerNorm.apply(*ours, torch.Size([16]), 1e-5)
    y_ref = torch.nn.functional.layer_norm(ref[0], (16,), ref[1], ref[2], 1e-5)
    torch.testing.assert_close(y, y_ref)
    y.backward(dy)
    y_ref.backward(dy)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a.grad, r.grad)


def test_layer_norm_without_affine_matches_torch() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    out, mean, invvar = layer_norm.forward(x.detach(), [8], 1e-5)
    ref = torch.nn.functional.layer_norm(x, (8,), eps=1e-5)
    torch.testing.assert_close(out, ref)
    dy = torch.randn(3, 8)
    ref.backward(dy)
    torch.testing.assert_close(layer_norm.backward(dy, mean, invvar, x.detach(), [8], 1e-5),
                               x.grad)


def test_apex_module_has_no_contrib_so_megatron_skips_persistent_layer_norm() -> None:
    import sys

    from mindio_ttp.compat.journal import Journal

    journal = Journal()
    apex_standins.install(journal)
    try:
        with pytest.raises(ImportError):
            __import__("apex.contrib.layer_norm.layer_norm")
        from apex.optimizers import FusedAdam as Imported
        assert Imported is FusedAdam
        assert sys.modules["amp_C"].multi_tensor_l2norm is multi_tensor_l2norm
    finally:
        journal.undo()
    assert "amp_C" not in sys.modules and "apex" not in sys.modules


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, weight_decay=0.1),
                                  lambda ps: FusedSGD(ps, momentum=0.9)], ids=["adam", "sgd"])
def test_a_copy_keeps_apex_options_and_steps_like_the_original(make) -> None:
    """ReplicatedOptimizer builds the partner stripe's optimizer with copy.copy, which goes
    through torch's Optimizer.__getstate__ (defaults, state, param_groups only)."""
    import collections
    import copy

    ours, theirs = _params(), _params()
    original = make(ours)
    twin = copy.copy(original)
    twin.state = collections.defaultdict(dict)
    twin.param_groups = [dict(g, params=theirs) for g in original.param_groups]
    _assert_same_steps(original, twin, ours, theirs)
    twin.zero_grad()
    assert twin.set_grad_none == original.set_grad_none
