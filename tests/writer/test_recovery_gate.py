"""The gate of in-memory recovery (D7): recover in memory only where the stack can abort a
collective another thread waits in and build new groups after the abort, asked of the stack's
features (compat/features.recovery_support), never of a version string; elsewhere the dying
checkpoint, with the reason. Doubles of each torch release's ProcessGroupNCCL binding and of
torch_npu; the real default group of a gloo world for the rank-side check."""

from __future__ import annotations

import sys
import tempfile
import types
from datetime import timedelta
from typing import Tuple

import pytest
import torch
import torch.distributed as dist

from mindio_ttp.compat import features


def _binding(*names: str) -> object:
    return types.SimpleNamespace(**{n: (lambda *a: None) for n in names})


# (abort names bound on ProcessGroupNCCL, torch has _abort_process_group, NCCL, recovers?)
STACKS = {
    "torch 2.1 (pip: NCCL 2.18)": (("_abort",), False, (2, 18, 1), False),
    "torch 2.4 (pip: NCCL 2.20)": (("_shutdown",), False, (2, 20, 5), False),
    "torch 2.6 (pip: NCCL 2.21.5)": (("abort", "_shutdown"), True, (2, 21, 5), False),
    "torch 2.6 + NGC's NCCL 2.26": (("abort", "_shutdown"), True, (2, 26, 2), True),
    "torch 2.11 (NCCL 2.28)": (("abort",), True, (2, 28, 9), True),
}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_nccl_recovers_in_memory_only_with_an_abort_a_group_abort_and_its_nccl(
        stack: str, monkeypatch) -> None:
    names, group_abort, nccl, recovers = STACKS[stack]
    c10d = types.SimpleNamespace(**({"_abort_process_group": lambda *a: None}
                                    if group_abort else {}))
    monkeypatch.setattr(torch.distributed, "distributed_c10d", c10d)
    monkeypatch.setattr(features, "nccl_version", lambda: nccl)
    ok, why = features.recovery_support("nccl", _binding(*names))
    assert ok is recovers, why
    if not group_abort:
        assert "no group abort" in why and "#119797" in why
    elif not recovers:
        assert "NCCL 2.21.5 is older than 2.22.0" in why


def test_a_binding_without_any_abort_never_recovers(monkeypatch) -> None:
    monkeypatch.setattr(features, "nccl_version", lambda: (2, 26, 2))
    ok, why = features.recovery_support("nccl", _binding("shutdown"))
    assert not ok and "none of abort, _shutdown, _abort" in why


def test_an_unknown_nccl_version_is_not_taken_for_a_new_one(monkeypatch) -> None:
    monkeypatch.setattr(features, "nccl_version", lambda: None)
    ok, why = features.recovery_support("nccl", _binding("abort"))
    assert not ok and "NCCL unknown" in why


@pytest.mark.parametrize("npu, backend, recovers", [
    ({}, ("abort_hccl_comm",), False),  # torch_npu before v6.0.rc3: no device stop
    ({"stop_device": 1, "restart_device": 1}, ("abort",), False),  # no abort_hccl_comm
    ({"stop_device": 1, "restart_device": 1}, ("abort_hccl_comm",), True),
])
def test_hccl_recovers_with_torch_npus_device_stop_and_its_own_abort(
        npu: dict, backend: Tuple[str, ...], recovers: bool, monkeypatch) -> None:
    module = types.SimpleNamespace(npu=types.SimpleNamespace(
        **{k: (lambda *a: 0) for k in npu}))
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    ok, why = features.recovery_support("hccl", _binding(*backend))
    assert ok is recovers, why


def test_gloo_recovers_and_an_unknown_backend_does_not() -> None:
    assert features.recovery_support("gloo")[0]
    ok, why = features.recovery_support("mpi")
    assert not ok and "nccl, hccl and gloo only" in why


def test_the_version_string_is_never_read(monkeypatch) -> None:
    """An NGC nightly says 2.6.0a0 and binds 2.4's names: the binding decides."""
    monkeypatch.setattr(torch, "__version__", "2.6.0a0+ecf3bae40a.nv24.10")
    monkeypatch.setattr(features, "nccl_version", lambda: (2, 26, 2))
    ok, _ = features.recovery_support("nccl", _binding("abort"))
    monkeypatch.setattr(torch, "__version__", "1.0.0")
    assert features.recovery_support("nccl", _binding("abort"))[0] is ok


def test_the_rank_asks_its_default_groups_own_backends() -> None:
    """rejoin.stack_capability: the backends of the default group, as they are."""
    from mindio_ttp.megatron_ttp import rejoin

    assert not rejoin.stack_capability()[0]  # no world yet
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    try:
        ok, why = rejoin.stack_capability()
    finally:
        dist.destroy_process_group()
    assert ok and why.startswith("gloo: a dead peer's collective raises"), why


def test_ttprun_says_the_mode_at_start_and_where_the_stack_cannot_uses_the_dying_checkpoint(
        monkeypatch) -> None:
    from mindio_ttp.launch import preflight

    monkeypatch.setattr(preflight, "_stack", lambda: ("nccl", _binding("_abort"), "CUDA"))
    monkeypatch.setattr(torch.distributed, "distributed_c10d", types.SimpleNamespace())
    said, forced = preflight.recovery_mode({})
    assert forced == "dying-checkpoint"
    assert said.startswith("recovery mode: dying checkpoint, not in memory (CUDA: this torch "
                           "has no group abort"), said
    said, forced = preflight.recovery_mode({"TTP_RECOVERY": "dying-checkpoint"})
    assert forced is None and said == "recovery mode: dying checkpoint (TTP_RECOVERY=" \
        "dying-checkpoint)"
    monkeypatch.setattr(preflight, "_stack", lambda: ("gloo", None, "no GPU or NPU here"))
    said, forced = preflight.recovery_mode({})
    assert forced is None and said.startswith("recovery mode: in memory (no GPU or NPU here")


def test_rank_0s_answer_on_the_jobs_own_groups_is_printed_by_ttprun(tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """ttprun's check at start sees the machine; rank 0 checks the groups the job made (a
    test backend that emulates torch 2.1 on a CPU, say) and ttprun prints that answer too."""
    from mindio_ttp import framework_ttp
    from mindio_ttp.launch.agent import TTPElasticAgent

    monkeypatch.setenv("TTP_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("TTP_RECOVERY", raising=False)
    framework_ttp._say_recovery_mode((False, "this torch has no group abort"))
    agent = types.SimpleNamespace(_run_dir=tmp_path, _mode_said="")
    for _ in range(2):  # printed once, however often the monitor loop looks
        TTPElasticAgent._say_recovery_mode(agent)
    # ttprun's lines only: a thread an earlier test left behind may log into a closed stream
    # here ("--- Logging error ---"), which is not what this test is about
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ttprun:")]
    assert said == ["ttprun: recovery mode (rank 0, on the job's process groups): dying "
                    "checkpoint, not in memory: this torch has no group abort"]
