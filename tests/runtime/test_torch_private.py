"""ttprun overrides private torch names (launch/torch_private.py): the installed torch still has
each of them as ttprun uses it, and the check would say so if one drifted."""

from __future__ import annotations

import subprocess
import sys

from torch.distributed.elastic.agent.server import local_elastic_agent as lea

from mindio_ttp.launch import torch_private


def test_the_installed_torch_has_every_private_name_ttprun_uses():
    assert torch_private.problems() == []


def test_a_drifted_name_is_reported_by_name(monkeypatch):
    def renamed(self, worker_group, is_restart=False):
        pass
    monkeypatch.setattr(lea.LocalElasticAgent, "_restart_workers", renamed)
    for cls in lea.LocalElasticAgent.__mro__:  # wherever this torch defines it
        if "_invoke_run" in vars(cls):
            monkeypatch.delattr(cls, "_invoke_run")
    monkeypatch.setattr(lea.LocalElasticAgent, "_runtime_started", lambda self: True,
                        raising=False)
    found = "\n".join(torch_private.problems())
    assert "_restart_workers('self', 'worker_group', 'is_restart')" in found
    assert "_invoke_run is gone" in found
    assert "LocalElasticAgent now has _runtime_started" in found


def test_the_check_runs_as_a_command_for_the_stack_bench():
    out = subprocess.run([sys.executable, "-m", "mindio_ttp.launch.torch_private"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "every private name ttprun uses is there" in out.stdout
