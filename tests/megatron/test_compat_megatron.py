"""A tree patched with `ttp-patch apply --device cuda` imports and reads its checkpoints on the
torch this package requires, with nothing of the CPU adaptor (Megatron-LM 285068c, real tree).

What a CPU can exercise, in a fresh interpreter: importing the patched `pretrain_gpt.py` (all of
Megatron's modules the training imports, clip_grads, distrib_optimizer and checkpointing among
them), with only what a CUDA machine has and this one lacks stood up for the import: apex and
amp_C (names only, nothing runs) and torchvision (training.py imports the DINO knn_monitor). Then
three Megatron code paths that fail on torch 2.x without the compatibility layer:
`optimizer/clip_grads.py:6` (`torch._six`), the param-buffer view of
`optimizer/distrib_optimizer.py:391` (`storage()._untyped()`, Megatron's own expression
evaluated on a grad buffer) and `checkpointing._load_base_checkpoint` on a checkpoint shaped like
Megatron's (a pickled argparse.Namespace and numpy RNG state: torch >= 2.6 refuses both).
What needs a GPU is not exercised: CUDA kernels, NCCL, apex's fused optimizers. Training a
patched tree end to end on CPU is the `--device cpu` tree, which is this tree plus one import
of the CPU adaptor (tests/megatron/test_e2e_dying_checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.megatron

PROBE = textwrap.dedent(
    """
    import ast, importlib.util, json, math, sys, types
    tree, ckpt = sys.argv[1], sys.argv[2]
    import torch
    stock_is_available = torch.cuda.is_available
    # What a CUDA machine has and this one lacks, stood up for the imports only.
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod
    module("apex.optimizers", FusedAdam=torch.optim.AdamW, FusedSGD=torch.optim.SGD)
    module("apex.multi_tensor_apply", multi_tensor_applier=None)
    module("apex", optimizers=sys.modules["apex.optimizers"],
           multi_tensor_apply=sys.modules["apex.multi_tensor_apply"])
    module("amp_C", multi_tensor_l2norm=None, multi_tensor_scale=None)
    class Torchvision:  # training.py imports the DINO knn_monitor, which needs torchvision
        def find_spec(self, name, path=None, target=None):
            if name != "megatron.model.vision.knn_monitor":
                return None
            return importlib.util.spec_from_loader(name, self)
        def create_module(self, spec):
            return None
        def exec_module(self, mod):
            mod.compute_feature_bank = None
    sys.meta_path.insert(0, Torchvision())
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("pretrain_gpt", tree + "/pretrain_gpt.py")
    pretrain_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain_gpt)
    order = [n for n in sys.modules if n in ("mindio_ttp.compat", "megatron")]
    out = {"order": order, "adaptor": "mindio_ttp.cpu_adaptor" in sys.modules,
           "stock_cuda": torch.cuda.is_available is stock_is_available}
    import mindio_ttp.compat as compat
    out["applied"] = compat.applied()
    from megatron.optimizer import clip_grads, distrib_optimizer
    out["inf"] = clip_grads.inf == math.inf
    source = open(distrib_optimizer.__file__).read()
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and "_untyped" in (ast.get_source_segment(source, n) or "")
             and isinstance(n.func, ast.Attribute) and n.func.attr == "tensor"]
    grad = types.SimpleNamespace(data=torch.arange(8, dtype=torch.float32))
    view = eval(ast.get_source_segment(source, calls[0]),
                {"torch": torch, "grad_buffer": grad, "params_dtype": torch.float16})
    out["view"] = [str(view.dtype), view.numel(), view.data_ptr() == grad.data.data_ptr()]
    from megatron import checkpointing
    state, _, release = checkpointing._load_base_checkpoint(ckpt, False, rank0=True)
    out["loaded"] = [state["iteration"], state["args"].lr, state["model"]["w"].tolist()]
    print("PROBE " + json.dumps(out))
    """
)


def megatron_shaped_checkpoint(root: Path) -> Path:
    """What `checkpointing.save_checkpoint` writes without the distributed optimizer."""
    (root / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    torch.save({"args": argparse.Namespace(lr=1.5e-4), "checkpoint_version": 3.0,
                "iteration": 3, "model": {"w": torch.tensor([1.0, 2.0])}, "rng_state": [rng]},
               root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    return root


def test_cuda_tree_imports_and_loads_a_checkpoint_without_the_cpu_adaptor(
    megatron_tree_factory, tmp_path: Path
) -> None:
    tree = megatron_tree_factory(patched=True, device="cuda")
    ckpt = megatron_shaped_checkpoint(tmp_path / "ckpt")
    done = subprocess.run([sys.executable, "-c", PROBE, str(tree), str(ckpt)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-3000:]
    got = json.loads(lines[-1][len("PROBE "):])
    assert got["order"] == ["mindio_ttp.compat", "megatron"]  # the tree's own line, first
    assert got["adaptor"] is False and got["stock_cuda"] is True
    assert got["inf"] is True
    assert got["view"] == ["torch.float16", 16, True]  # a view of the grad buffer, as meant
    assert got["loaded"] == [3, 1.5e-4, [1.0, 2.0]]
    print(f"torch {torch.__version__}: compat applied {got['applied']}")
