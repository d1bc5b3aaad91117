"""Fixtures for tests that run real Megatron-LM 285068c on CPU.

All of them need ``TTP_MEGATRON_DIR`` (the ``megatron_dir`` fixture in tests/conftest.py skips
without it). The dataset and the tree copies are made once per session; tests that edit a tree
take a fresh copy from ``megatron_tree_factory``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from mindio_ttp.demo.rehearsal.data import TinyDataset, make_tiny_dataset
from mindio_ttp.demo.rehearsal.tree import apply_ttp_patch, copy_megatron_tree

TreeFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_dataset(megatron_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TinyDataset:
    """Corpus, GPT-2 BPE vocab/merges and mmap dataset, written with Megatron's classes."""
    return make_tiny_dataset(megatron_dir, tmp_path_factory.mktemp("tiny_dataset"))


@pytest.fixture(scope="session")
def megatron_tree_factory(megatron_dir: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> TreeFactory:
    """``make(patched: bool = False, device: str = 'cpu') -> Path``: a fresh private tree."""

    def make(patched: bool = False, device: str = "cpu") -> Path:
        tree = copy_megatron_tree(megatron_dir, tmp_path_factory.mktemp("megatron") / "tree")
        if patched:
            try:
                apply_ttp_patch(tree, device=device)
            except RuntimeError as exc:
                pytest.fail(str(exc))
        return tree

    return make


@pytest.fixture(scope="session")
def unpatched_megatron_tree(megatron_tree_factory: TreeFactory) -> Path:
    """A pristine copy, shared by tests that only run it (with the adaptor injected)."""
    return megatron_tree_factory(patched=False)


@pytest.fixture(scope="session")
def patched_megatron_tree(megatron_tree_factory: TreeFactory) -> Path:
    """A copy after ``ttp-patch apply --device cpu``, shared by tests that only run it."""
    return megatron_tree_factory(patched=True)


@pytest.fixture(scope="session")
def saved_every_iteration(patched_megatron_tree: Path, tiny_dataset: TinyDataset,
                          tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted tiny-GPT run (DP4, 10 iterations) with Megatron's own save after every
    iteration: the oracle a dying checkpoint of any step is compared with, tensor for tensor."""
    from megatron_e2e import N_ITERS, run_job

    work = tmp_path_factory.mktemp("every_iteration")
    ckpt = work / "ref_ckpt"
    result = run_job(patched_megatron_tree, tiny_dataset, work / "ref.log", ckpt,
                     save_interval=1)
    assert result.returncode == 0, result.tail()
    assert sorted(result.losses) == list(range(1, N_ITERS + 1)), result.tail()
    return ckpt
