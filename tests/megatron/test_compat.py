"""The compatibility layer (mindio_ttp.compat): each drift fix applied only where the installed
torch and numpy need it, scoped to Megatron's calls where it changes an answer, all undone on
uninstall, refused after Megatron. No Megatron needed (the real tree: test_compat_megatron.py).
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

import mindio_ttp.compat as compat
from mindio_ttp.compat import CompatError, features

compat.uninstall()  # importing the package installs it; tests install it when they need it
STOCK_LOAD = torch.load


@pytest.fixture
def installed() -> Iterator[None]:
    compat.install()
    try:
        yield
    finally:
        compat.uninstall()


def as_module(name: str, source: str) -> dict:
    namespace: dict = {"__name__": name, "torch": torch}
    exec(compile(source, "<fake>", "exec"), namespace)
    return namespace


def test_this_torch_gets_exactly_the_fixes_its_features_call_for() -> None:
    needed = {"torch._six": features.lacks_torch_six(),
              "TypedStorage._untyped": features.lacks_typed_storage_untyped(),
              "torch.load weights_only=False for Megatron":
                  features.load_defaults_to_weights_only()}
    try:
        applied = compat.install()
        assert {a for a in applied if not a.startswith("numpy ")} == \
            {name for name, need in needed.items() if need}
        # what Megatron 285068c does, whichever fixes this torch needed:
        from torch._six import inf  # optimizer/clip_grads.py:6

        assert inf == float("inf")
        assert np.float is float and np.int is int  # data/indexed_dataset.py:98,271
        untyped = torch.zeros(4).storage()._untyped()  # optimizer/distrib_optimizer.py:391
        assert untyped.nbytes() == 16
    finally:
        compat.uninstall()


def test_torch_load_defaults_to_full_unpickling_only_for_megatron(
    installed: None, tmp_path: Path
) -> None:
    if not features.load_defaults_to_weights_only():
        pytest.skip(f"torch {torch.__version__} does not default to weights_only")
    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(lr=1.0), "np_rng": np.random.get_state()}, path)
    ns = as_module("megatron.checkpointing", "def load(p):\n    return torch.load(p)\n")
    assert ns["load"](path)["args"].lr == 1.0
    with pytest.raises(Exception, match="weights_only"):
        torch.load(path)  # anyone else keeps torch's safe default


def test_nothing_is_applied_where_the_installed_torch_needs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch with _six, _untyped and weights_only=False, and a numpy with the aliases (the
    NGC 22.12 stack Megatron 285068c was written for): the layer changes nothing."""
    monkeypatch.setattr(features, "lacks_torch_six", lambda: False)
    monkeypatch.setattr(features, "lacks_typed_storage_untyped", lambda: False)
    monkeypatch.setattr(features, "load_defaults_to_weights_only", lambda: False)
    monkeypatch.setattr(features, "missing_numpy_aliases", lambda: [])
    try:
        assert compat.install() == []
        assert torch.load is STOCK_LOAD and "torch._six" not in sys.modules
        assert "float" not in np.__dict__
        assert "_untyped" not in torch.storage.TypedStorage.__dict__
    finally:
        compat.uninstall()


def test_feature_checks_read_the_signature_not_the_version(monkeypatch) -> None:
    def old_load(f, map_location=None, pickle_module=None, *, weights_only=False):
        return None

    def new_load(f, map_location=None, pickle_module=None, *, weights_only=None):
        return None

    def no_param_load(f, map_location=None, pickle_module=None):
        return None

    monkeypatch.setattr(torch, "load", old_load)
    assert not features.load_defaults_to_weights_only()  # 1.13 .. 2.5
    monkeypatch.setattr(torch, "load", no_param_load)
    assert not features.load_defaults_to_weights_only()  # < 1.13
    monkeypatch.setattr(torch, "load", new_load)
    monkeypatch.setattr(torch.serialization, "_default_to_weights_only", lambda pm: True,
                        raising=False)
    assert features.load_defaults_to_weights_only()  # >= 2.6
    assert features.torch_version() >= (1, 0)


def test_install_is_idempotent_and_uninstall_restores_stock() -> None:
    first = compat.install()
    wrapped = torch.load
    assert compat.install() == first and torch.load is wrapped
    compat.uninstall()
    assert torch.load is STOCK_LOAD and not compat.is_installed() and compat.applied() == []
    assert "float" not in np.__dict__ and "_untyped" not in torch.storage.TypedStorage.__dict__


def test_install_after_megatron_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    with pytest.raises(CompatError, match="right after `import torch`"):
        compat.install()
    assert not compat.is_installed() and torch.load is STOCK_LOAD


def test_failed_install_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> bool:
        raise OSError("disk on fire")

    monkeypatch.setattr(features, "lacks_typed_storage_untyped", broken)
    with pytest.raises(OSError):
        compat.install()
    assert not compat.is_installed() and torch.load is STOCK_LOAD
    assert "float" not in np.__dict__
