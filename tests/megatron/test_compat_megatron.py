"""A tree patched with `ttp-patch apply --device cuda` imports and reads its checkpoints on the
torch this package requires, with nothing of the CPU adaptor (Megatron-LM 285068c, real tree).

What the probe exercises and what it cannot (CUDA kernels, NCCL, apex's fused optimizers):
testkit/cuda_tree_probe.py. Training a patched tree end to end on CPU is the `--device cpu`
tree, which is this tree plus one import of the CPU adaptor (test_e2e_dying_checkpoint.py).
On a torch without any of the drift (the NGC 22.12 nightly) the layer applies nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from testkit.cuda_tree_probe import megatron_shaped_checkpoint, run_probe

pytestmark = pytest.mark.megatron


def test_cuda_tree_imports_and_loads_a_checkpoint_without_the_cpu_adaptor(
    megatron_tree_factory, tmp_path: Path
) -> None:
    tree = megatron_tree_factory(patched=True, device="cuda")
    got = run_probe(sys.executable, tree, megatron_shaped_checkpoint(tmp_path / "ckpt"))
    assert got["order"] == ["mindio_ttp.compat", "megatron"]  # the tree's own line, first
    assert got["adaptor"] is False and got["stock_cuda"] is True
    assert got["inf"] is True  # optimizer/clip_grads.py:6
    assert got["view"] == ["torch.float16", 16, True]  # distrib_optimizer.py:391, a view
    assert got["loaded"] == [3, 1.5e-4, [1.0, 2.0]]  # checkpointing.py:399
    print(f"torch {torch.__version__}: compat applied {got['applied']}")
