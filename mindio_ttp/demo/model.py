"""The demo's training math: a tiny MLP, seeded data, ZeRO-1-style sharded Adam.

Every function here is deterministic on CPU (one thread, fixed shapes, gradients summed in rank
order rather than by an all-reduce whose order is up to the backend), so the same steps give the
same bits in a 4-process gloo job, in a resumed job, and in the single-process `emulate` used by
tests. The parameters live in one flat fp32 vector; the optimizer state is split into `replica`
shards and DP position i holds shard ``i % replica`` (so positions i and i+replica are copies).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

IN, HIDDEN, OUT = 8, 16, 4
BATCH = 16
SEED = 1234
LR = 0.02
BETAS = (0.9, 0.999)
EPS = 1e-8
CLIP = 1.0
_SHAPES = [(HIDDEN, IN), (HIDDEN,), (OUT, HIDDEN), (OUT,)]


@dataclass(frozen=True)
class ShardLayout:
    """Which slice of the flat vector each optimizer shard covers."""

    world: int
    replica: int
    numel: int  # real parameters
    padded: int  # numel rounded up to a multiple of replica

    @classmethod
    def for_world(cls, world: int, replica: Optional[int] = None) -> ShardLayout:
        replica = world // 2 if replica is None else replica
        if world < 2 or replica < 1 or world % replica:
            raise ValueError(
                f"world {world} with {replica} shards: need world >= 2 and divisible by the "
                "shard count, so that every shard has the same number of copies"
            )
        numel = sum(math.prod(s) for s in _SHAPES)
        padded = -(-numel // replica) * replica
        return cls(world, replica, numel, padded)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.replica

    def shard_of(self, position: int) -> int:
        return position % self.replica

    def bounds(self, shard: int) -> slice:
        return slice(shard * self.shard_numel, (shard + 1) * self.shard_numel)


@dataclass
class ShardState:
    """One rank's view: full parameters, its optimizer shard, and the step that shard reached."""

    layout: ShardLayout
    shard: int
    params: torch.Tensor  # padded flat vector (requires_grad)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0  # number of finished optimizer updates of this shard

    @classmethod
    def fresh(cls, layout: ShardLayout, shard: int) -> ShardState:
        gen = torch.Generator().manual_seed(SEED)
        params = torch.zeros(layout.padded)
        params[: layout.numel] = torch.randn(layout.numel, generator=gen) * 0.3
        zeros = torch.zeros(layout.shard_numel)
        return cls(layout, shard, params.requires_grad_(), zeros.clone(), zeros.clone(), 0)


def batch(step: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of DP position ``position`` at optimizer step ``step`` (1-based): seeded by both."""
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + position)
    x = torch.randn(BATCH, IN, generator=gen)
    target = torch.sin(x[:, :OUT] * 1.5) + 0.5 * x[:, OUT : 2 * OUT]
    return x, target


def forward_backward(params: torch.Tensor, step: int, position: int) -> tuple[float, torch.Tensor]:
    """Loss and the flat gradient of one position's batch."""
    if params.grad is not None:
        params.grad = None
    views, offset = [], 0
    for shape in _SHAPES:
        n = math.prod(shape)
        views.append(params[offset : offset + n].view(shape))
        offset += n
    w1, b1, w2, b2 = views
    x, target = batch(step, position)
    out = torch.tanh(x @ w1.t() + b1) @ w2.t() + b2
    loss = torch.mean((out - target) ** 2)
    loss.backward()
    grad = params.grad.detach().clone()
    params.grad = None
    return float(loss.detach()), grad


def reduce_grads(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean of the positions' gradients, summed in position order (bit-reproducible)."""
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total / len(grads)


def clip(grad: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Clip by global norm (the gradient is already the full reduced one on every rank)."""
    norm = float(torch.linalg.vector_norm(grad))
    coef = min(1.0, CLIP / (norm + 1e-6))
    return grad * coef, norm


def lr_at(step: int) -> float:
    return LR * (1.0 - 0.5 * min(step, 100) / 100)


def adam_update(state: ShardState, grad: torch.Tensor, step: int) -> None:
    """Adam on this rank's shard only; leaves ``state.step`` to the caller (end of the window)."""
    sl = state.layout.bounds(state.shard)
    g = grad[sl]
    b1, b2 = BETAS
    state.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
    state.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
    bias1 = 1 - b1**step
    bias2 = 1 - b2**step
    denom = (state.exp_avg_sq / bias2).sqrt_().add_(EPS)
    with torch.no_grad():
        state.params[sl].addcdiv_(state.exp_avg / bias1, denom, value=-lr_at(step))


def assemble(layout: ShardLayout, shard_params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Flat parameters from the slices of positions 0..world-1 (the first copy of each shard)."""
    return torch.cat([shard_params[s] for s in range(layout.replica)])


@dataclass
class FullState:
    """Everything a run's result is compared on: parameters and every optimizer shard."""

    step: int
    params: torch.Tensor
    exp_avg: List[torch.Tensor]
    exp_avg_sq: List[torch.Tensor]

    def tensors(self) -> Dict[str, torch.Tensor]:
        out = {"params": self.params.detach()}
        for k, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq)):
            out[f"exp_avg.{k}"] = m
            out[f"exp_avg_sq.{k}"] = v
        return out

    def digest(self) -> str:
        h = hashlib.sha256(str(self.step).encode())
        for name, t in sorted(self.tensors().items()):
            h.update(name.encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def differences(self, other: FullState) -> List[str]:
        """Names whose bits differ (empty when identical)."""
        diffs = [] if self.step == other.step else [f"step {self.step} != {other.step}"]
        mine, theirs = self.tensors(), other.tensors()
        for name in sorted(mine):
            a, b = mine[name], theirs.get(name)
            if b is None or a.shape != b.shape or not torch.equal(a, b):
                diffs.append(name)
        return diffs

    def to_dict(self) -> dict:
        return {"step": self.step, **{k: v.clone() for k, v in self.tensors().items()}}

    @classmethod
    def from_dict(cls, data: dict) -> FullState:
        replica = sum(1 for k in data if k.startswith("exp_avg."))
        return cls(
            int(data["step"]),
            data["params"],
            [data[f"exp_avg.{k}"] for k in range(replica)],
            [data[f"exp_avg_sq.{k}"] for k in range(replica)],
        )


def emulate(layout: ShardLayout, steps: int, start: Optional[FullState] = None) -> FullState:
    """Run the 4-rank job in one process: what every rank computes, in the same order."""
    torch.set_num_threads(1)
    shards = [ShardState.fresh(layout, s) for s in range(layout.replica)]
    begin = 0
    if start is not None:
        begin = start.step
        for s, st in enumerate(shards):
            with torch.no_grad():
                st.params.copy_(start.params)
            st.exp_avg.copy_(start.exp_avg[s])
            st.exp_avg_sq.copy_(start.exp_avg_sq[s])
            st.step = begin
    params = shards[0].params
    for step in range(begin + 1, steps + 1):
        grads = [forward_backward(params, step, p)[1] for p in range(layout.world)]
        grad, _ = clip(reduce_grads(grads))
        for st in shards:
            with torch.no_grad():
                st.params.copy_(params)
            adam_update(st, grad, step)
            st.step = step
        with torch.no_grad():
            params = assemble(
                layout, [shards[s].params[layout.bounds(s)] for s in range(layout.replica)]
            ).requires_grad_()
    return FullState(
        steps, params.detach(), [s.exp_avg for s in shards], [s.exp_avg_sq for s in shards]
    )
