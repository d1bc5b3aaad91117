"""faulttime/abort.py on CPU: every communicator aborted in parallel and within the bound
(doubles of NCCL/HCCL backends whose aborts wait for each other, hang or raise), torch_npu's
device stop and restart on the bound NPU, gloo left alone, and real gloo processes that abort,
destroy their groups and build working new ones (what the recovery needs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

from mindio_ttp.faulttime import abort
from mindio_ttp.faulttime.device import DeviceBinding

REPO = Path(__file__).resolve().parents[2]


class FakeBackend:
    """A process group whose only backend is `kind`, with an abort() the test scripts."""

    def __init__(self, name: str, kind: str = "nccl", on_abort=None) -> None:
        self.group_name, self.kind, self.on_abort = name, kind, on_abort
        self.calls: List[str] = []

    def name(self) -> str:
        return self.kind

    def abort(self) -> None:
        self.calls.append("abort")
        if self.on_abort is not None:
            self.on_abort()

    def _shutdown(self) -> None:
        self.calls.append("_shutdown")


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


def test_torch_before_2_6_shuts_nccl_down_as_nvrx_does(monkeypatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    group = FakeBackend("dp")
    assert abort.abort_all(timeout_s=2.0, groups=[group]).ok
    assert group.calls == ["_shutdown"]


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
    procs = [subprocess.Popen([sys.executable, str(script), str(r), first, second],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
        got = json.loads(stdout.strip().splitlines()[-1])
        assert got["before"] == 2.0 and got["after"] == 3.0, got
        assert got["outcomes"] == [abort.SKIPPED] and got["groups"] == 2  # world + pair: gloo
        assert got["destroyed"] and not got["initialized_after"]
