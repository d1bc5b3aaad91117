"""Does a `ttp-patch apply --device cuda` tree import and read checkpoints on this torch, with
nothing of the CPU adaptor? Run in a fresh interpreter: ``python testkit/cuda_tree_probe.py
TREE CKPT`` prints one ``PROBE {json}`` line (tests/megatron/test_compat_megatron.py and
bench/bench_stack.py read it).

What a CPU can exercise: importing the patched ``pretrain_gpt.py`` (every Megatron module the
training imports, clip_grads, distrib_optimizer and checkpointing among them) with only what a
CUDA machine has and this one lacks stood up for the import: apex and amp_C (names only, nothing
of them runs) and torchvision (training.py imports the DINO knn_monitor). Then three Megatron
code paths that fail on torch 2.x without the compatibility layer: ``optimizer/clip_grads.py:6``
(``torch._six``), the param-buffer view of ``optimizer/distrib_optimizer.py:391``
(``storage()._untyped()``: Megatron's own expression, evaluated on a grad buffer) and
``checkpointing._load_base_checkpoint`` on a checkpoint shaped like Megatron's (a pickled
argparse.Namespace and numpy RNG state: torch >= 2.6 refuses both by default). Not exercised:
CUDA kernels, NCCL, apex's fused optimizers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

SCRIPT = Path(__file__).resolve()


def megatron_shaped_checkpoint(root: Path) -> Path:
    """What `checkpointing.save_checkpoint` writes without the distributed optimizer."""
    import argparse
    import random

    import numpy as np
    import torch

    (root / "iter_0000003" / "mp_rank_00").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    torch.save({"args": argparse.Namespace(lr=1.5e-4), "checkpoint_version": 3.0,
                "iteration": 3, "model": {"w": torch.tensor([1.0, 2.0])}, "rng_state": [rng]},
               root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    return root


def run_probe(python: str, tree: Path, ckpt: Path, timeout_s: float = 240) -> Dict[str, Any]:
    """The probe's answer from interpreter `python`; RuntimeError with its output otherwise."""
    done = subprocess.run([python, str(SCRIPT), str(tree), str(ckpt)], capture_output=True,
                          text=True, timeout=timeout_s, cwd=ckpt.parent)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    if done.returncode != 0 or not lines:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"probe exited {done.returncode}:\n{tail}")
    return json.loads(lines[-1][len("PROBE "):])


class _Torchvision:
    """Serves megatron.model.vision.knn_monitor, which needs torchvision, as an empty stub."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        import importlib.util

        if name != "megatron.model.vision.knn_monitor":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        module.compute_feature_bank = None


def _probe(tree: str, ckpt: str) -> Dict[str, Any]:
    import ast
    import importlib.util
    import math
    import types

    import torch

    stock_is_available = torch.cuda.is_available

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    module("apex.optimizers", FusedAdam=torch.optim.AdamW, FusedSGD=torch.optim.SGD)
    module("apex.multi_tensor_apply", multi_tensor_applier=None)
    module("apex", optimizers=sys.modules["apex.optimizers"],
           multi_tensor_apply=sys.modules["apex.multi_tensor_apply"])
    module("amp_C", multi_tensor_l2norm=None, multi_tensor_scale=None)
    sys.meta_path.insert(0, _Torchvision())
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("pretrain_gpt", tree + "/pretrain_gpt.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    out: Dict[str, Any] = {
        "torch": torch.__version__,
        "order": [n for n in sys.modules if n in ("mindio_ttp.compat", "megatron")],
        "adaptor": "mindio_ttp.cpu_adaptor" in sys.modules,
        "stock_cuda": torch.cuda.is_available is stock_is_available,
    }
    from megatron import checkpointing
    from megatron.optimizer import clip_grads, distrib_optimizer

    import mindio_ttp.compat as compat

    out["applied"] = compat.applied()
    out["inf"] = clip_grads.inf == math.inf
    source = Path(distrib_optimizer.__file__).read_text()
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "tensor"
             and "_untyped" in (ast.get_source_segment(source, n) or "")]
    grad = types.SimpleNamespace(data=torch.arange(8, dtype=torch.float32))
    view = eval(ast.get_source_segment(source, calls[0]),  # noqa: S307 (Megatron's own text)
                {"torch": torch, "grad_buffer": grad, "params_dtype": torch.float16})
    out["view"] = [str(view.dtype), view.numel(), view.data_ptr() == grad.data.data_ptr()]
    state, _, _ = checkpointing._load_base_checkpoint(ckpt, False, rank0=True)
    out["loaded"] = [state["iteration"], state["args"].lr, state["model"]["w"].tolist()]
    return out


if __name__ == "__main__":
    print("PROBE " + json.dumps(_probe(sys.argv[1], sys.argv[2])), flush=True)
