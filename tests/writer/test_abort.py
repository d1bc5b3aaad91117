"""faulttime/abort.py on CPU: every communicator aborted in parallel and within the bound
(doubles of NCCL/HCCL backends whose aborts wait for each other, hang or raise), the abort found
by feature on each torch's binding and inside the bounded thread (D1), HCCL's own abort (D11),
the device bound in every aborting thread (D13), NCCL's group abort where the binding has it,
torch_npu's device stop and restart on the bound NPU, gloo left alone, and real gloo processes
that abort, destroy their groups and build working new ones (what the recovery needs)."""

from __future__ import annotations

import functools
import json
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest
import torch

from mindio_ttp.faulttime import abort
from mindio_ttp.faulttime.device import DeviceBinding
from testkit.procs import run_together

REPO = Path(__file__).resolve().parents[2]


class FakeBackend:
    """A process group whose only backend is `kind`, bound with the abort methods `names` (the
    names one torch release binds; `abort` by default), each recorded when called."""

    def __init__(self, name: str, kind: str = "nccl", on_abort=None,
                 names: Tuple[str, ...] = ("abort",), group_calls: bool = False,
                 log: Optional[List[str]] = None) -> None:
        self.group_name, self.kind, self.on_abort = name, kind, on_abort
        self.calls: List[str] = []
        self.log = log if log is not None else []
        for method in names + (("_group_start", "_group_end") if group_calls else ()):
            setattr(self, method, functools.partial(self._called, method))

    def name(self) -> str:
        return self.kind

    def _called(self, method: str, *args) -> None:
        self.calls.append(method)
        self.log.append(f"{method} {self.group_name} in {threading.current_thread().name}")
        if self.on_abort is not None and not method.startswith("_group"):
            self.on_abort()


# the abort names each torch binds on ProcessGroupNCCL (device_review_2.md, D1)
BINDINGS = {"2.1": ("_abort",), "2.2-2.4": ("_shutdown",), "2.5-2.6": ("abort", "_shutdown"),
            "2.7+": ("abort",)}


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown, so a deliberately hung abort thread ends with the test."""
    event = threading.Event()
    yield event
    event.set()


def test_groups_are_aborted_in_parallel_not_one_after_the_other() -> None:
    # each abort returns only once the other one has started: in sequence they would deadlock
    both = threading.Barrier(2, timeout=5)
    groups = [FakeBackend("tp", on_abort=both.wait), FakeBackend("dp", on_abort=both.wait)]
    report = abort.abort_all(timeout_s=5.0, groups=groups)
    assert report.ok, report.describe()
    assert sorted(report.aborted) == ["dp", "tp"]
    assert report.seconds < 5.0
    assert all(g.calls == ["abort"] for g in groups)


def test_a_hung_abort_is_reported_within_the_bound_and_the_others_still_abort(release) -> None:
    hung = FakeBackend("stuck", on_abort=release.wait)
    fine = FakeBackend("dp")
    t0 = time.monotonic()
    report = abort.abort_all(timeout_s=0.5, groups=[hung, fine])
    took = time.monotonic() - t0
    assert took < 2.0, took  # bounded: the hung thread is left behind
    outcomes = {g.group: g.outcome for g in report.groups}
    assert outcomes == {"stuck": abort.TIMED_OUT, "dp": abort.ABORTED}
    assert not report.ok
    assert "stuck (nccl): timed out" in report.describe()


def test_a_failing_abort_is_reported_not_raised() -> None:
    def boom() -> None:
        raise RuntimeError("ncclCommAbort failed: unhandled system error")

    report = abort.abort_all(timeout_s=2.0, groups=[FakeBackend("dp", on_abort=boom)])
    (only,) = report.groups
    assert only.outcome == abort.FAILED and "unhandled system error" in only.detail


@pytest.mark.parametrize("torch_binding", sorted(BINDINGS))
def test_the_abort_is_found_by_feature_on_every_torch_binding(torch_binding) -> None:
    """D1: torch 2.1 binds only ``_abort``; asking it for ``abort`` raised AttributeError out of
    abort_all, so every dying save and every recovery failed there."""
    names = BINDINGS[torch_binding]
    group = FakeBackend("dp", names=names)
    report = abort.abort_all(timeout_s=2.0, groups=[group])
    assert report.ok, report.describe()
    assert group.calls == [names[0]]  # abort, else _shutdown, else _abort


def test_the_version_string_decides_nothing(monkeypatch) -> None:
    """An NGC nightly reads as 2.6 but may bind 2.4's name: the binding decides (D1)."""
    monkeypatch.setattr(torch, "__version__", "2.6.0a0+ecf3bae40a.nv24.10")
    group = FakeBackend("dp", names=("_shutdown",))
    assert abort.abort_all(timeout_s=2.0, groups=[group]).ok
    assert group.calls == ["_shutdown"]


def test_a_backend_without_any_abort_is_reported_failed_within_the_bound() -> None:
    report = abort.abort_all(timeout_s=2.0, groups=[FakeBackend("dp", names=())])
    (only,) = report.groups
    assert only.outcome == abort.FAILED and "none of abort, _shutdown, _abort" in only.detail


def test_the_abort_is_looked_up_inside_the_bounded_call(release) -> None:
    """Reading the attribute can itself fail or block (a binding that raises, a lock inside a
    property): abort_all still returns within its bound and says which group (D1)."""

    class Raising(FakeBackend):
        @property
        def abort(self):
            raise RuntimeError("ProcessGroupNCCL is being destroyed")

    class Blocking(FakeBackend):
        @property
        def abort(self):
            release.wait()

    t0 = time.monotonic()
    report = abort.abort_all(timeout_s=0.5, groups=[Raising("a", names=()),
                                                    Blocking("b", names=())])
    assert time.monotonic() - t0 < 2.0
    outcomes = {g.group: (g.outcome, g.detail) for g in report.groups}
    assert outcomes["a"][0] == abort.FAILED and "being destroyed" in outcomes["a"][1]
    assert outcomes["b"][0] == abort.TIMED_OUT


def test_hccl_is_aborted_with_its_own_call_never_the_base_class_no_op() -> None:
    """D11: torch_npu binds ``abort_hccl_comm``; from torch 2.7 ``Backend.abort`` exists and
    does nothing for HCCL, so calling it reported "aborted" while nothing was."""
    group = FakeBackend("dp", kind="hccl", names=("abort", "abort_hccl_comm"))
    report = abort.abort_all(timeout_s=2.0, groups=[group])
    assert report.ok and report.aborted == ["dp"]
    assert group.calls == ["abort_hccl_comm"]
    assert group.log == ["abort_hccl_comm dp in ttp-abort-dp"]


def test_every_aborting_thread_binds_the_device_first(monkeypatch) -> None:
    """D13: a new thread's current CUDA device is 0; an abort there can make a context on
    another rank's GPU. Each thread binds this rank's device before it aborts."""
    log: List[str] = []
    monkeypatch.setattr(torch, "cuda", types.SimpleNamespace(
        set_device=lambda i: log.append(f"set_device({i}) in {threading.current_thread().name}")))
    groups = [FakeBackend("tp", log=log), FakeBackend("dp", log=log)]
    report = abort.abort_all(timeout_s=2.0, binding=DeviceBinding("cuda", 5), groups=groups)
    assert report.ok, report.describe()
    for name in ("tp", "dp"):
        mine = [line for line in log if line.endswith(f"ttp-abort-{name}")]
        assert mine == [f"set_device(5) in ttp-abort-{name}",
                        f"abort {name} in ttp-abort-{name}"], log


def test_where_the_binding_has_group_calls_every_nccl_group_aborts_inside_one() -> None:
    """torch's own _abort_process_group: _group_start, every abort, _group_end, one thread
    (NCCL then aborts the hung communicators together, pytorch #119797)."""
    log: List[str] = []

    def boom() -> None:
        if threading.current_thread().name == "ttp-abort-nccl" and len(log) == 3:
            raise RuntimeError("ncclCommAbort: unhandled system error")

    groups = [FakeBackend(n, group_calls=True, log=log, on_abort=boom) for n in ("tp", "pp", "dp")]
    report = abort.abort_all(timeout_s=2.0, groups=groups)
    assert [line.split(" in ")[0] for line in log] == [
        "_group_start tp", "abort tp", "abort pp", "abort dp", "_group_end tp"]
    assert {line.split(" in ")[1] for line in log} == {"ttp-abort-nccl"}
    outcomes = {g.group: g.outcome for g in report.groups}
    assert outcomes == {"tp": abort.ABORTED, "pp": abort.FAILED, "dp": abort.ABORTED}


def test_gloo_and_unknown_backends_are_left_alone() -> None:
    gloo, other = FakeBackend("cpu", kind="gloo"), FakeBackend("x", kind="mpi")
    report = abort.abort_all(timeout_s=1.0, groups=[gloo, other])
    assert report.ok and not report.aborted
    assert {g.outcome for g in report.groups} == {abort.SKIPPED}
    assert gloo.calls == other.calls == []


def test_on_npu_the_device_is_stopped_then_restarted_once_for_every_hccl_group(
        monkeypatch) -> None:
    log: List[str] = []
    npu = types.SimpleNamespace(
        stop_device=lambda i: log.append(f"stop({i})") or 0,
        restart_device=lambda i: log.append(f"restart({i})"))
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(
        set_device=lambda i: log.append(f"set_device({i})")), raising=False)
    groups = [FakeBackend("tp", kind="hccl"), FakeBackend("dp", kind="hccl")]
    report = abort.abort_all(timeout_s=2.0, binding=DeviceBinding("npu", 3), groups=groups)
    assert report.ok, report.describe()
    assert log == ["set_device(3)", "stop(3)", "restart(3)"]  # bound first, in its thread
    assert sorted(report.aborted) == ["dp", "tp"] and report.device == "npu:3 stopped and restarted"
    assert all(g.calls == [] for g in groups)  # the device stop ended their work


def test_an_npu_whose_stop_fails_is_not_reported_as_stopped(monkeypatch) -> None:
    npu = types.SimpleNamespace(stop_device=lambda i: 1, restart_device=lambda i: None)
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(set_device=lambda i: None),
                        raising=False)
    report = abort.abort_all(timeout_s=2.0, binding=DeviceBinding("npu", 0),
                             groups=[FakeBackend("dp", kind="hccl")])
    assert not report.ok and report.device.startswith(abort.FAILED)
    assert report.groups[0].outcome == abort.FAILED


WORKER = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from mindio_ttp.faulttime import abort

    rank, first, second = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    out = {}
    dist.init_process_group("gloo", store=dist.FileStore(first, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    pair = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=pair)
    out["before"] = t.item()
    report = abort.abort_all(timeout_s=5.0, destroy=True)
    out["outcomes"] = sorted({g.outcome for g in report.groups})
    out["groups"], out["destroyed"] = len(report.groups), report.destroyed
    out["initialized_after"] = dist.is_initialized()
    # the recovery's next step: a fresh rendezvous, new groups, collectives that work
    dist.init_process_group("gloo", store=dist.FileStore(second, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=dist.new_group([0, 1]))
    out["after"] = t.item()
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def test_gloo_processes_abort_destroy_and_build_working_groups_again(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    first, second = str(tmp_path / "store1"), str(tmp_path / "store2")
    results = run_together([[sys.executable, str(script), str(r), first, second]
                            for r in range(2)], timeout=120, cwd=REPO)
    for returncode, stdout, stderr in results:
        assert returncode == 0, stderr[-3000:]
        got = json.loads(stdout.strip().splitlines()[-1])
        assert got["before"] == 2.0 and got["after"] == 3.0, got
        assert got["outcomes"] == [abort.SKIPPED] and got["groups"] == 2  # world + pair: gloo
        assert got["destroyed"] and not got["initialized_after"]
