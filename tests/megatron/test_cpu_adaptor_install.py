"""Installing the CPU adaptor: scoping to Megatron callers, hooks, refusal, undo.

No Megatron needed: a fake ``megatron`` package in a temporary folder stands in for the
modules the hooks target. The adaptor (and the compatibility layer it installs with it) is
installed for one test at a time and uninstalled after, so the rest of the suite sees stock
torch. The drift fixes themselves are tested in test_compat.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Iterator

import numpy as np
import pytest
import torch

import mindio_ttp.compat as compat
import mindio_ttp.cpu_adaptor as adaptor
from mindio_ttp.cpu_adaptor import CPUAdaptorError, helpers_build

adaptor.uninstall()  # importing the package installs it; tests install it when they need it
compat.uninstall()

STOCK_IS_AVAILABLE = torch.cuda.is_available
STOCK_LOAD = torch.load

FAKE_MODULES = {
    "megatron/__init__.py": "",
    "megatron/initialize.py": "def set_jit_fusion_options():\n    raise RuntimeError('nvfuser')\n",
    "megatron/fused_kernels/__init__.py": "def load(args):\n    raise RuntimeError('nvcc')\n",
    "megatron/core/__init__.py": "",
    "megatron/core/tensor_parallel/__init__.py": "",
    "megatron/core/tensor_parallel/random.py":
        "def _set_cuda_rng_state(new_state, device=-1):\n    raise RuntimeError('lazy')\n",
    "megatron/model/__init__.py": "",
    "megatron/model/vision/__init__.py": "",
    "megatron/model/vision/knn_monitor.py": "import torchvision_is_not_installed\n",
    "megatron/data/__init__.py": "",
    "megatron/data/dataset_utils.py": "def compile_helper():\n    raise RuntimeError('make')\n",
}


def _drop_fake_megatron() -> None:
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]


@pytest.fixture
def installed() -> Iterator[None]:
    adaptor.install()
    try:
        yield
    finally:
        _drop_fake_megatron()
        adaptor.uninstall()
        compat.uninstall()


@pytest.fixture
def fake_megatron(tmp_path: Path) -> Iterator[Path]:
    for rel, text in FAKE_MODULES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        _drop_fake_megatron()


def as_module(name: str, source: str, filename: str = "<fake>") -> Dict[str, Any]:
    """Execute ``source`` as if it were module ``name`` defined in ``filename``."""
    namespace: Dict[str, Any] = {"__name__": name, "torch": torch}
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)
    return namespace


CALLS = """
def probe():
    t = torch.ones(2)
    return {
        "is_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "current_device": torch.cuda.current_device(),
        "type": t.type(),
        "cuda_is_identity": t.cuda() is t,
        "typed": torch.cuda.FloatTensor([1.0]).type(),
        "memory": torch.cuda.memory_allocated(),
    }
"""


def test_megatron_callers_get_cpu_answers(installed: None) -> None:
    for name in ("megatron.training", "mindio_ttp.megatron_ttp.save"):
        got = as_module(name, CALLS)["probe"]()
        assert got["is_available"] is True and got["device_count"] == 1
        assert got["current_device"] == torch.device("cpu")
        assert got["type"] == got["typed"] == "torch.cuda.FloatTensor"
        assert got["cuda_is_identity"] and got["memory"] > 0


def test_other_callers_keep_stock_torch(installed: None) -> None:
    for name in ("__main__", "mindio_ttp.framework_ttp", "megatronish", "tests.x"):
        probe = as_module(name, CALLS.replace('"cuda_is_identity": t.cuda() is t,', ""))
        with pytest.raises((AssertionError, RuntimeError)):
            probe["probe"]()  # stock torch.cuda.current_device on a CPU build
    assert torch.cuda.is_available() == STOCK_IS_AVAILABLE()
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_megatron_entry_script_run_as_main_counts_as_megatron(
    installed: None, tmp_path: Path
) -> None:
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    inside = as_module("__main__", CALLS, str(tmp_path / "pretrain_gpt.py"))
    outside = as_module("__main__", "def probe():\n    return torch.cuda.device_count()\n",
                        str(tmp_path / "megatron" / "elsewhere" / "x.py"))
    assert inside["probe"]()["device_count"] == 1
    assert outside["probe"]() == 0


def test_rng_calls_drive_the_cpu_default_generator(installed: None) -> None:
    ns = as_module("megatron.core.tensor_parallel.random", """
        def roundtrip():
            torch.cuda.manual_seed(7)
            state = torch.cuda.get_rng_state()
            a = torch.rand(3)
            torch.cuda.set_rng_state(state)
            return a, torch.rand(3), torch.cuda.initial_seed()
    """)
    a, b, seed = ns["roundtrip"]()
    assert torch.equal(a, b) and seed == 7


def test_dataloader_gets_private_generator_only_for_megatron(installed: None) -> None:
    ns = as_module("megatron.data.data_samplers",
                   "def build(ds):\n    return torch.utils.data.DataLoader(ds)\n")
    assert ns["build"]([1, 2]).generator is not None
    assert torch.utils.data.DataLoader([1, 2]).generator is None
    before = torch.get_rng_state()
    iter(ns["build"]([1, 2]))
    assert torch.equal(torch.get_rng_state(), before), "iterator consumed the default RNG"


def test_hooks_replace_megatron_functions_at_import(installed: None,
                                                    fake_megatron: Path) -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.fused_kernels import load
    from megatron.initialize import set_jit_fusion_options
    from megatron.model.vision import knn_monitor

    load(argparse.Namespace(rank=1))
    assert set_jit_fusion_options() is None
    state = torch.get_rng_state()
    torch.rand(4)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(NotImplementedError, match="knn_monitor"):
        knn_monitor.compute_feature_bank()


def test_compat_comes_with_the_adaptor_and_env_default(installed: None) -> None:
    """An unpatched tree run through the adaptor (the baselines) gets the drift fixes too."""
    import torch._six as six

    assert compat.is_installed() and six.inf == float("inf")
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert sys.modules["fused_mix_prec_layer_norm_cuda"].forward_affine


def test_process_groups_destroyed_at_exit(installed: None, free_port: int) -> None:
    import torch.distributed as dist

    from mindio_ttp.cpu_adaptor.cpu_torch import destroy_process_groups_at_exit

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0,
                            world_size=1)
    dist.all_reduce(torch.ones(1))
    destroy_process_groups_at_exit()
    assert not dist.is_initialized()
    destroy_process_groups_at_exit()  # nothing left: a no-op


def test_install_is_idempotent_and_uninstall_restores_stock() -> None:
    import atexit

    callbacks = atexit._ncallbacks()
    adaptor.install()
    assert atexit._ncallbacks() == callbacks + 1  # the process-group cleanup
    wrapped = torch.cuda.is_available
    adaptor.install()
    assert torch.cuda.is_available is wrapped and wrapped.__wrapped__ is STOCK_IS_AVAILABLE
    adaptor.uninstall()
    assert compat.is_installed(), "the compatibility layer is not the adaptor's to remove"
    assert torch.cuda.is_available is STOCK_IS_AVAILABLE and "amp_C" not in sys.modules
    assert "cuda" not in torch.Tensor.__dict__ and not adaptor.is_installed()
    compat.uninstall()
    assert torch.load is STOCK_LOAD and "float" not in np.__dict__


def test_install_after_megatron_import_is_refused_and_changes_nothing(
    fake_megatron: Path,
) -> None:
    import megatron  # noqa: F401

    with pytest.raises(CPUAdaptorError, match="before any Megatron module"):
        adaptor.install()
    assert not adaptor.is_installed()
    assert torch.load is STOCK_LOAD and "amp_C" not in sys.modules


def test_failed_install_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from mindio_ttp.cpu_adaptor import megatron_hooks

    def broken(journal: Any) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(megatron_hooks, "install", broken)
    with pytest.raises(OSError):
        adaptor.install()
    assert not adaptor.is_installed() and torch.load is STOCK_LOAD
    assert not compat.is_installed(), "rolled back with the adaptor it came with"
    assert "apex" not in sys.modules and torch.cuda.is_available is STOCK_IS_AVAILABLE


def test_fresh_interpreter_import_order(fake_megatron: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(fake_megatron)!r})
        import torch
        import mindio_ttp.cpu_adaptor, mindio_ttp.cpu_adaptor
        print("installed", mindio_ttp.cpu_adaptor.is_installed())
        del sys.modules["mindio_ttp.cpu_adaptor"]
        mindio_ttp.cpu_adaptor.uninstall()
        import megatron
        try:
            import mindio_ttp.cpu_adaptor
        except RuntimeError as exc:
            print("refused", type(exc).__name__, exc)
        print("stock", "amp_C" not in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "installed True" in done.stdout
    assert "refused CPUAdaptorError" in done.stdout and "right after `import torch`" in done.stdout
    assert "stock True" in done.stdout


HELPERS_SOURCE = """
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "helpers", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_helpers() { return PyModule_Create(&def); }
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_helpers_are_built_out_of_tree_and_imported(
    installed: None, fake_megatron: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pybind11")
    monkeypatch.setenv(helpers_build.BUILD_DIR_ENV, str(tmp_path / "build"))
    source = fake_megatron / "megatron" / "data" / "helpers.cpp"
    source.write_text(HELPERS_SOURCE)
    from megatron.data.dataset_utils import compile_helper

    compile_helper()
    from megatron.data import helpers

    assert helpers.answer() == 42
    assert Path(helpers.__file__).parent.parent == tmp_path / "build"
    assert not list(source.parent.glob("helpers*.so")), "built into the Megatron tree"


def test_scoped_wrapper_reports_original(installed: None) -> None:
    fn: Callable[..., Any] = torch.cuda.device_count
    assert fn.__wrapped__ is not fn  # type: ignore[attr-defined]


def test_flat_collectives_fall_back_where_gloo_refuses_them(free_port: int) -> None:
    """torch 2.1's gloo refuses _all_gather_base/_reduce_scatter_base before sending anything;
    Megatron's calls then get all_gather / all_reduce, anyone else keeps the refusal."""
    import torch.distributed as dist

    from mindio_ttp.cpu_adaptor import gloo_collectives as gc

    def refusing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no support for _allgather_base in Gloo process group")

    gather = gc._with_fallback("test_gather", gc._gather)(refusing)
    scatter = gc._with_fallback("test_scatter", gc._reduce_scatter)(refusing)
    ns = as_module("megatron.timers", "def call(fn, *a, **k):\n    return fn(*a, **k)\n")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0,
                            world_size=1)
    try:
        out = torch.zeros(3)
        assert ns["call"](gather, out, torch.tensor([1.0, 2.0, 3.0])) is None
        assert out.tolist() == [1.0, 2.0, 3.0]
        handle = ns["call"](scatter, out, torch.tensor([4.0, 5.0, 6.0]), async_op=True)
        handle.wait()
        assert out.tolist() == [4.0, 5.0, 6.0]
        with pytest.raises(RuntimeError, match="no support"):
            gather(out, torch.ones(3))  # not Megatron: the refusal stands
    finally:
        dist.destroy_process_group()
