"""Real Megatron-LM 285068c on CPU through ``mindio_ttp.cpu_adaptor``.

The unpatched tree runs with the adaptor injected by
``python -m mindio_ttp.demo.rehearsal.runner``: the adaptor alone must make it train, and a
run stopped at iteration 10 and resumed with ``--load`` must print the same 20 losses and write
a bit-identical iteration-20 checkpoint. The patched tree (``ttp-patch apply --device cpu``)
must import the adaptor from ``pretrain_gpt.py`` before Megatron and get as far as the TTP glue.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.demo.rehearsal.data import TinyDataset
from mindio_ttp.demo.rehearsal.launch import PretrainResult, run_pretrain, tiny_gpt_args

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 20
STOP_AT = 10
LAUNCH_TIMEOUT_S = 300


def _ok(result: PretrainResult, what: str) -> PretrainResult:
    assert not result.timed_out, f"{what} timed out after {result.wall_s:.0f}s:\n{result.tail()}"
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{result.tail()}"
    assert not result.leftovers, f"{what}: launcher left ranks running: {result.leftovers}"
    return result


def _report(name: str, full: PretrainResult, first: PretrainResult,
            resumed: PretrainResult) -> None:
    print(f"\n[{name}] wall: uninterrupted {full.wall_s:.1f}s, stop@{STOP_AT} "
          f"{first.wall_s:.1f}s, resume {resumed.wall_s:.1f}s; "
          f"ms/iter (iters 3..) {full.ms_per_iter():.1f}")
    both = {**first.losses, **resumed.losses}
    for it, loss in sorted(full.losses.items()):
        print(f"  {it:3d}  {loss}  {both.get(it, '-')}")


@pytest.mark.parametrize("nproc,tensor_parallel", [(2, 1), (4, 2)], ids=["dp2", "tp2dp2"])
def test_unpatched_megatron_resumes_bit_exact_with_adaptor(
    unpatched_megatron_tree: Path, tiny_dataset: TinyDataset, tmp_path: Path,
    nproc: int, tensor_parallel: int,
) -> None:
    def launch(name: str, ckpt: Path, exit_interval: int | None = None) -> PretrainResult:
        args = tiny_gpt_args(tiny_dataset, train_iters=ITERS, tensor_parallel=tensor_parallel,
                             distributed_optimizer=True, save=ckpt, load=ckpt,
                             save_interval=STOP_AT, exit_interval=exit_interval)
        result = run_pretrain(unpatched_megatron_tree, args, nproc=nproc,
                              log_path=tmp_path / f"{name}.log",
                              timeout_s=LAUNCH_TIMEOUT_S, inject_adaptor=True)
        return _ok(result, name)

    full = launch("uninterrupted", tmp_path / "ckpt_full")
    first = launch("stopped", tmp_path / "ckpt_resumed", exit_interval=STOP_AT)
    resumed = launch("resumed", tmp_path / "ckpt_resumed")
    _report(f"dp{nproc // tensor_parallel} tp{tensor_parallel} distopt", full, first, resumed)

    assert sorted(full.losses) == list(range(1, ITERS + 1)), full.tail()
    assert sorted(first.losses) == list(range(1, STOP_AT + 1)), first.tail()
    assert sorted(resumed.losses) == list(range(STOP_AT + 1, ITERS + 1)), resumed.tail()
    assert {**first.losses, **resumed.losses} == full.losses
    assert float(full.losses[ITERS]) < float(full.losses[1]), "the model did not learn"
    for iteration in (STOP_AT, ITERS):
        comparison = compare_checkpoints(tmp_path / "ckpt_full", tmp_path / "ckpt_resumed",
                                         iteration)
        assert comparison.bit_exact, comparison.summary()


def test_patched_pretrain_gpt_installs_adaptor_before_megatron(
    patched_megatron_tree: Path,
) -> None:
    # Import pretrain_gpt.py as a plain module (not __main__, so it does not train): its
    # imports must all succeed, the adaptor must already be active when Megatron loads, and
    # the TTP glue must be reached (megatron/training.py imports it).
    probe = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {str(patched_megatron_tree)!r})
        spec = importlib.util.spec_from_file_location(
            "pretrain_gpt", {str(patched_megatron_tree / "pretrain_gpt.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        import mindio_ttp.cpu_adaptor as adaptor
        order = [n for n in sys.modules if n in ("mindio_ttp.cpu_adaptor", "megatron")]
        print("installed", adaptor.is_installed())
        print("order", ",".join(order))
        print("glue", "mindio_ttp.megatron_ttp" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installed True" in done.stdout
    assert "order mindio_ttp.cpu_adaptor,megatron" in done.stdout
    assert "glue True" in done.stdout
