"""ttprun overrides and reads private torch names (launch/torch_private.py): the installed torch
still has each of them as ttprun uses them, the check would say so by name if one drifted, and
ttprun refuses such a torch at start. bench/bench_stack.py runs this file under every torch of
the stack table (docs/stack.md)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import pytest
import torch.distributed.run as torch_run
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server import local_elastic_agent as lea
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from mindio_ttp.launch import agent, takeover, torch_private


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


def test_the_rendezvous_arguments_ttprun_check_reads_are_checked(monkeypatch):
    monkeypatch.setattr(torch_run, "get_rdzv_endpoint", lambda args, default_port: "")
    monkeypatch.delattr(torch_run, "_parse_rendezvous_config")
    found = "\n".join(torch_private.problems())
    assert "torch.distributed.run._parse_rendezvous_config is gone" in found
    assert "get_rdzv_endpoint('args', 'default_port') is not ('args',)" in found
    assert "ttprun --check" in found  # what breaks


def test_a_rendezvous_config_parser_that_answers_otherwise_is_reported(monkeypatch):
    monkeypatch.setattr(torch_run, "_parse_rendezvous_config",
                        lambda config_str: [tuple(kv.split("=")) for kv in config_str.split(",")])
    found = "\n".join(torch_private.problems())
    assert "_parse_rendezvous_config('join_timeout=5,x=y') gives [(" in found


def test_the_c10d_handler_internals_the_takeover_reads_are_checked(monkeypatch):
    init = dr.DynamicRendezvousHandler.__init__

    def drifted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._holder = self.__dict__.pop("_state_holder")
        self._node = self.__dict__.pop("_this_node")
    monkeypatch.setattr(dr.DynamicRendezvousHandler, "__init__", drifted)
    found = "\n".join(torch_private.problems())
    assert "the c10d rendezvous handler has no _state_holder" in found
    assert "the c10d rendezvous handler has no _this_node" in found


def test_a_rendezvous_state_of_another_shape_is_reported(monkeypatch):
    init = dr._RendezvousState.__init__

    def drifted(self):
        init(self)
        self.participants = list(self.participants)
        del self.wait_list
    monkeypatch.setattr(dr._RendezvousState, "__init__", drifted)
    found = "\n".join(torch_private.problems())
    assert "the c10d rendezvous state's participants is list, not a dict" in found
    assert "the c10d rendezvous state's wait_list is gone, not a set" in found


def _without_redundancy_list(monkeypatch):
    init = dr._RendezvousState.__init__

    def old(self):
        init(self)
        self.__dict__.pop("redundancy_list", None)
    monkeypatch.setattr(dr._RendezvousState, "__init__", old)


def test_a_torch_without_a_redundancy_list_runs_without_takeovers_and_says_so(monkeypatch,
                                                                              caplog):
    before = torch_private.problems()  # [] but on a torch refused for something else
    _without_redundancy_list(monkeypatch)
    found, accepted = torch_private.check()
    assert found == before
    assert any(line.startswith("no node takeover: this torch lacks the rendezvous state's "
                               "redundancy_list") for line in accepted)
    with caplog.at_level(logging.WARNING, logger="ttprun"):
        assert takeover.available() is False
    assert "no node takeover on this torch" in caplog.text


def test_a_takeover_piece_missing_beside_a_redundancy_list_is_reported(monkeypatch):
    init = dr._RendezvousState.__init__

    def with_list(self):
        init(self)
        self.redundancy_list = getattr(self, "redundancy_list", set())
    monkeypatch.setattr(dr._RendezvousState, "__init__", with_list)
    monkeypatch.delattr(mp_api, "get_subprocess_handler", raising=False)
    found = "\n".join(torch_private.problems())
    assert "this torch has a redundancy list but lacks" in found
    assert "get_subprocess_handler" in found


class WorkerGroupWithoutMaster:
    """A worker group of the shape torch 2.1 has: no master_addr, no master_port."""

    def __init__(self, spec):
        self.spec = spec
        self.store = None


def test_a_worker_group_without_master_addr_needs_the_store_keys_to_be_read(monkeypatch):
    monkeypatch.setattr(agent_api, "WorkerGroup", WorkerGroupWithoutMaster)
    monkeypatch.delattr(agent_api.SimpleElasticAgent, "_get_master_addr_port", raising=False)
    found = "\n".join(torch_private.problems())
    assert "WorkerGroup has no master_addr/master_port" in found
    assert "restarted attempt" in found


def test_a_launcher_that_cannot_parse_its_own_default_is_reported(monkeypatch):
    """torch 1.13.1 on Python 3.11: Std.from_str('0') gives None, every launch fails."""
    monkeypatch.setattr(mp_api.Std, "from_str", classmethod(lambda cls, vm: None))
    found = "\n".join(torch_private.problems())
    assert "torch's Std.from_str('0') is None, not Std.NONE" in found


def test_the_older_shutdown_is_accepted_and_handed_exactly_what_torch_passes(monkeypatch):
    calls = []
    before = torch_private.problems()  # [] but on a torch refused for something else

    def old_shutdown(self, death_sig=signal.SIGTERM):  # torch 2.1's
        calls.append(death_sig)
    monkeypatch.setattr(lea.LocalElasticAgent, "_shutdown", old_shutdown)
    found, accepted = torch_private.check()
    assert found == before
    assert any("LocalElasticAgent._shutdown('self', 'death_sig'): an older shape" in line
               for line in accepted)

    class Closable:
        def close(self):
            pass
    me = object.__new__(agent.TTPElasticAgent)
    me._spares, me._siblings, me._node_agent = Closable(), None, None
    me._shutdown()
    me._shutdown(signal.SIGKILL)
    assert calls == [signal.SIGTERM, signal.SIGKILL]


@pytest.mark.parametrize("backend, shared, expected", [
    ("static", None, True), ("c10d", None, False),  # torch 2.1: no use_agent_store
    ("c10d", True, True), ("c10d", False, False)])  # 2.13: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
def test_a_restart_gets_its_own_store_only_where_the_workers_use_the_launchers(backend, shared,
                                                                             expected):
    class Handler:
        def get_backend(self):
            return backend
    handler = Handler()
    if shared is not None:
        handler.use_agent_store = shared
    assert agent._workers_use_agent_store(handler) is expected


def test_ttprun_refuses_a_drifted_torch_at_start_naming_what_drifted(monkeypatch, capsys):
    monkeypatch.delattr(torch_run, "_parse_rendezvous_config")
    assert agent.main(["--nproc-per-node=1", "never_started.py"]) == 2
    err = capsys.readouterr().err
    assert "ttprun: error: torch " in err
    assert "  - torch.distributed.run._parse_rendezvous_config is gone: ttprun --check" in err
    assert "nothing was started" in err


def test_the_check_runs_as_a_command_for_the_stack_bench():
    out = subprocess.run([sys.executable, "-m", "mindio_ttp.launch.torch_private"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "every private name ttprun uses is there" in out.stdout


def test_the_list_of_ttpruns_own_helpers_is_the_agents_own():
    """The check reads a list, not the class (the agent runs the check at start: no import
    circle); the list must be the class's private helpers that override nothing of torch's."""
    from mindio_ttp.launch.agent import TTPElasticAgent

    ours = {n for n, v in vars(TTPElasticAgent).items()
            if callable(v) and n.startswith("_") and not n.startswith("__")}
    assert set(torch_private.OWN_HELPERS) == ours - set(torch_private.OVERRIDDEN)
