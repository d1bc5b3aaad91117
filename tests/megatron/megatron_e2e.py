"""Shared steps of the real-Megatron end-to-end tests of the dying checkpoint.

A job is the tiny GPT of mindio_ttp.demo.rehearsal on 4 ranks, launched by `ttprun` on a tree
patched with `ttp-patch apply --device cpu`. Faults come from the test-only sitecustomize in
fault_hook/ (put on the workers' PYTHONPATH), driven by a FaultPlan text such as
"1:5:sigkill:before": the Megatron tree carries nothing but the patch.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mindio_ttp.demo.rehearsal.data import TinyDataset
from mindio_ttp.demo.rehearsal.launch import (
    Launcher,
    PretrainJob,
    PretrainResult,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.faulttime import manifest
from testkit.hooks import GLOO, NCCL_LIKE, backend_setup  # noqa: F401 - the tests take them here

TTP_OT_S = 40  # seconds ttprun keeps survivors alive after a fault
N_ITERS = 10
FAR_AWAY = 10_000  # periodic save interval that never fires
DYING = "+dying"  # a case suffix: the same fault with TTP_RECOVERY=dying-checkpoint


def cases(ci: Sequence[str] = (), extended: Sequence[str] = ()) -> List[object]:
    """Parameters of a test over backends (and modes): `ci` run in every CI run, `extended`
    only with ``pytest --extended`` (the rest of the fault matrix: tests/conftest.py)."""
    import pytest

    return [*ci, *(pytest.param(c, marks=pytest.mark.extended) for c in extended)]


def split_case(case: str) -> Tuple[str, bool]:
    """("nccl-like@2.1", dying?) of a case such as "nccl-like@2.1+dying"."""
    return case.removesuffix(DYING), case.endswith(DYING)


def assert_saved_bit_exact(result: PretrainResult, ckpt: Path, ref_ckpt: Path, step: int,
                           layout: manifest.ParallelLayout) -> None:
    """A failed job whose dying checkpoint of `step` is latest, complete, and bit-identical to
    Megatron's own save of `step` in `ref_ckpt`."""
    from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints

    assert result.returncode != 0, result.tail(8000)
    assert tracker_step(ckpt) == step, result.tail(8000)
    assert manifest.verify(ckpt / manifest.iter_dir_name(step), layout) is None
    assert not list(ckpt.glob(".ttp_tmp_*"))
    comparison = compare_checkpoints(ckpt, ref_ckpt, step)
    assert comparison.bit_exact, comparison.summary()


def run_job(tree: Path, data: TinyDataset, log: Path, ckpt: Path, *, iters: int = N_ITERS,
            plan: str = "", tp: int = 1, save_interval: int = FAR_AWAY, load: bool = True,
            launcher: Launcher = Launcher.TTPRUN, inject_adaptor: bool = False,
            distributed_optimizer: bool = True, nproc: int = 4, extra: Sequence[str] = (),
            env_extra: Optional[Dict[str, str]] = None, timeout_s: float = 240,
            launcher_args: Sequence[str] = (), backend: str = GLOO) -> PretrainResult:
    backend_env, backend_args = backend_setup(backend)
    env: Dict[str, str] = {
        **backend_env,
        "TTP_OT": str(TTP_OT_S),
        "TTP_CONTROLLER_PORT": str(pick_free_port()),
        **(env_extra or {}),
    }
    if plan:
        record = log.parent / f"{log.stem}.faults"
        record.mkdir(parents=True, exist_ok=True)
        env.update({"TTP_FAULT_PLAN": plan, "TTP_FAULT_RECORD_DIR": str(record)})
    args = tiny_gpt_args(data, train_iters=iters, tensor_parallel=tp,
                         distributed_optimizer=distributed_optimizer, save=ckpt,
                         load=ckpt if load else None, save_interval=save_interval,
                         extra=[*extra, *backend_args])
    with PretrainJob(tree, args, nproc=nproc, log_path=log, launcher=launcher,
                     inject_adaptor=inject_adaptor, env=env, launcher_args=launcher_args) as job:
        result = job.wait(timeout_s)
    result.ended_at = time.time()  # wall clock, to compare with the fault record's time
    assert not result.timed_out, f"job timed out after {timeout_s} s:\n{result.tail()}"
    return result


def fault_time(log: Path, rank: int) -> float:
    """When the fault plan fired on `rank` (written by FaultPlan.check just before firing)."""
    record = log.parent / f"{log.stem}.faults" / f"fault-{rank}.json"
    return float(json.loads(record.read_text())["time"])


def tracker_step(ckpt: Path) -> Optional[int]:
    return manifest.read_tracker(ckpt)[0]


def copy_checkpoints(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def tb_scalars(folder: Path, tag: str = "lm loss") -> Dict[int, List[float]]:
    """{step: every value written for `tag` at that step}, over every event file in `folder`
    (Megatron's --tensorboard-dir: one file per process that wrote, a replacement's too)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: Dict[int, List[float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == tag:
                    out.setdefault(event.step, []).append(
                        float(tensor_util.make_ndarray(value.tensor)))
    return out


def log_lines(log: str) -> Dict[int, int]:
    """{iteration: how many times Megatron's training log line for it was printed}."""
    counts: Dict[int, int] = {}
    for it in _LINE_RE.findall(log):
        counts[int(it)] = counts.get(int(it), 0) + 1
    return counts


_LINE_RE = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|", re.MULTILINE)


def loss_table(columns: Dict[str, Dict[int, str]]) -> str:
    """Loss table for the report: one row per iteration, one column per run."""
    names = list(columns)
    iters = sorted({i for c in columns.values() for i in c})
    rows = ["iter " + " ".join(f"{n:>14}" for n in names)]
    rows += [f"{i:4d} " + " ".join(f"{columns[n].get(i, '-'):>14}" for n in names) for i in iters]
    return "\n".join(rows)


def assert_close_losses(a: Dict[int, str], b: Dict[int, str], rel: float = 1e-5) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for it in a:
        x, y = float(a[it]), float(b[it])
        assert abs(x - y) <= rel * abs(x), f"iteration {it}: {x} vs {y}"


def assert_same_structure_close_values(a: Path, b: Path, iteration: int,
                                       rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Checkpoints of two optimizers at `iteration`: same files, same keys, equal non-tensor
    leaves (param groups, scheduler, RNG), same tensor shapes/dtypes, values close."""
    import numpy as np
    import torch

    from mindio_ttp.demo.rehearsal.checkpoints import leaves, load_checkpoint_file

    rel_dir = manifest.iter_dir_name(iteration)
    files_a = sorted(p.relative_to(a) for p in (a / rel_dir).rglob("*.pt"))
    files_b = sorted(p.relative_to(b) for p in (b / rel_dir).rglob("*.pt"))
    assert files_a == files_b
    for rel in files_a:
        leaves_a = dict(leaves({k: v for k, v in load_checkpoint_file(a / rel).items()
                               if k != "args"}))
        leaves_b = dict(leaves({k: v for k, v in load_checkpoint_file(b / rel).items()
                               if k != "args"}))
        assert leaves_a.keys() == leaves_b.keys(), rel
        for key, x in leaves_a.items():
            y = leaves_b[key]
            if torch.is_tensor(x):
                assert x.shape == y.shape and x.dtype == y.dtype, f"{rel}{key}"
                assert torch.allclose(x.double(), y.double(), rtol=rtol, atol=atol), f"{rel}{key}"
            elif isinstance(x, np.ndarray):
                assert np.array_equal(x, y), f"{rel}{key}"
            elif key.endswith("/lr") or key.endswith("/weight_decay"):
                assert x == pytest_approx(y), f"{rel}{key}: {x} != {y}"
            else:
                assert x == y, f"{rel}{key}: {x!r} != {y!r}"


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, rel=1e-12)
