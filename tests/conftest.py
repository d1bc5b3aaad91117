"""Fixtures shared by every test directory: free loopback ports, the Megatron checkout, and a
reaper that fails a test which leaves child processes behind (multi-process tests must clean up
what they start, or CI machines fill with orphaned ranks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import psutil
import pytest

MEGATRON_ENV = "TTP_MEGATRON_DIR"
MEGATRON_COMMIT = "285068c8108e0e8e6538f54fe27c3ee86c5217a2"


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (outside the ephemeral range;
    see mindio_ttp.demo.rehearsal.launch.pick_free_port)."""
    from mindio_ttp.demo.rehearsal.launch import pick_free_port as pick

    return pick()


EXTENDED_ENV = "TTP_EXTENDED"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked `extended` (the fault matrix beyond CI's "
                          f"cases; or set {EXTENDED_ENV}=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Tests marked `extended` skip, saying how to run them, unless asked for."""
    if config.getoption("--extended") or os.environ.get(EXTENDED_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"extended fault matrix: run with --extended "
                                   f"(or {EXTENDED_ENV}=1)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def free_port() -> int:
    return pick_free_port()


@pytest.fixture(scope="session")
def megatron_dir() -> Path:
    """The Megatron-LM 285068c checkout named by TTP_MEGATRON_DIR; skips the test without it."""
    value = os.environ.get(MEGATRON_ENV)
    if not value:
        pytest.skip(
            f"{MEGATRON_ENV} is not set: point it at a Megatron-LM checkout at "
            f"{MEGATRON_COMMIT[:7]} to run the real-tree tests"
        )
    path = Path(value).resolve()
    if not (path / "pretrain_gpt.py").is_file():
        pytest.fail(f"{MEGATRON_ENV}={value} has no pretrain_gpt.py: not a Megatron-LM checkout")
    return path


def _multiprocessing_servers() -> set:
    """multiprocessing's forkserver and resource tracker: started by the first test that needs
    them (testkit/forking.py), they serve the whole session and end with it. The helpers they
    fork are still counted."""
    from multiprocessing import forkserver, resource_tracker

    return {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)} - {None}


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail the test if it leaves child processes running (after killing them)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftovers = [p for p in me.children(recursive=True)
                 if p.pid not in before and p.pid not in _multiprocessing_servers()]
    if not leftovers:
        return
    _, alive = psutil.wait_procs(leftovers, timeout=5)
    if not alive:
        return
    described = []
    for p in alive:
        try:
            described.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5)
    if described:
        pytest.fail("test left child processes running (killed now):\n" + "\n".join(described))
