"""ttprun gives the workers' gloo groups the interface of the route to MASTER_ADDR
(mindio_ttp/launch/gloo_iface.py): two namespaced nodes whose host names resolve to 127.0.1.1
(the Debian/Ubuntu default) run a gloo job across the link; without the variable, gloo binds to
127.0.1.1 and the nodes cannot connect. Plus the choice itself: the user's value wins, and a
multi-node job whose MASTER_ADDR is reached through loopback gets a warning, not a guess."""

from __future__ import annotations

import os
import secrets
import sys
import types
from pathlib import Path

import pytest

from mindio_ttp.launch import gloo_iface
from testkit.netns import TwoNodes, namespaces_unavailable, two_nodes

WORKER = """
import os, socket
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
name = socket.gethostname()
print(f"rank {dist.get_rank()}: {name} is {socket.gethostbyname(name)}, "
      f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}, sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_a_users_interface_is_kept_and_nothing_is_said() -> None:
    assert gloo_iface.choose({gloo_iface.NAME: "ib0"}, "127.0.0.1", True) == (None, "")


def test_loopback_on_a_multi_node_job_is_a_warning_not_a_guess() -> None:
    value, note = gloo_iface.choose({}, "127.0.0.1", multi_node=True)
    assert value is None and note.startswith("warning:") and gloo_iface.NAME in note
    value, note = gloo_iface.choose({}, "127.0.0.1", multi_node=False)
    assert value == "lo" and "route to MASTER_ADDR 127.0.0.1" in note


def test_an_unresolvable_master_addr_is_a_warning() -> None:
    value, note = gloo_iface.choose({}, "no-such-host.invalid", multi_node=True)
    assert value is None and "cannot resolve" in note


def test_the_rendezvous_host_comes_from_torchruns_arguments() -> None:
    ns = types.SimpleNamespace
    assert gloo_iface.rendezvous_host(ns(rdzv_backend="static", master_addr="10.0.0.1")) == \
        "10.0.0.1"
    assert gloo_iface.rendezvous_host(ns(rdzv_backend="c10d", rdzv_endpoint="n0:29400")) == "n0"
    assert gloo_iface.rendezvous_host(ns(rdzv_backend="c10d", rdzv_endpoint="[fd00::1]:1")) == \
        "fd00::1"


@pytest.mark.slow
def test_nodes_whose_names_resolve_to_127_0_1_1_still_connect(tmp_path: Path) -> None:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, TTP_AUTH_KEY=secrets.token_hex(32), PYTHONUNBUFFERED="1")
    env.pop(gloo_iface.NAME, None)
    port = 40000 + secrets.randbelow(20000)
    with two_nodes(tmp_path, TwoNodes) as nodes:
        for n in nodes.nodes:
            cmd = [sys.executable, "-m", "mindio_ttp.launch.agent",
                   *nodes.ttprun_args(n, nproc=1, port=port), str(script)]
            nodes.launch(n, cmd, env, gloo_ifname=False, hostname=f"ttp-node{n.index}")
        codes = [nodes.wait(n, 120) for n in nodes.nodes]
        out = nodes.outputs()
    assert codes == [0, 0], out
    for n in nodes.nodes:
        assert f"ttprun: {gloo_iface.NAME}={n.veth} (the interface of the route to MASTER_ADDR" \
            in n.output(), out
        assert f"ttp-node{n.index} is 127.0.1.1, GLOO_SOCKET_IFNAME={n.veth}, sum 3" in \
            n.output(), out
