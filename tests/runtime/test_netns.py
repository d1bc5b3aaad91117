"""The namespace fixture itself (testkit.netns): three nodes reach each other over the switch,
a cut isolates exactly the nodes named, and closing removes every namespace and link made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testkit.netns import Node, ip, made_nodes, namespaces_unavailable

CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()\n"
           "except OSError:\n"
           "    sys.exit(1)\n")
SERVE = ("import socket, sys\n"
         "s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(8)\n"
         "print('listening', flush=True)\n"
         "while True:\n"
         "    s.accept()[0].close()\n")
PORT = 47123


def _reaches(src: Node, dst: Node) -> bool:
    done = subprocess.run(["ip", "netns", "exec", src.ns, sys.executable, "-c", CONNECT,
                           dst.addr, str(PORT)], capture_output=True, timeout=20)
    return done.returncode == 0


@pytest.mark.timeout(120)
def test_three_nodes_on_one_switch_and_a_cut_isolates_one(tmp_path: Path) -> None:
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    with made_nodes(tmp_path, 3) as nodes:
        made = list(nodes._made)
        assert len(made) == 4 and nodes.switch in made  # three nodes and the switch
        servers = []
        for n in nodes.nodes:
            proc = subprocess.Popen(["ip", "netns", "exec", n.ns, sys.executable, "-c", SERVE,
                                     str(PORT)], stdout=subprocess.PIPE, text=True)
            n.proc = proc
            servers.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        a, b, c = nodes.nodes
        assert all(_reaches(x, y) for x, y in [(a, b), (a, c), (b, c), (c, a)])
        nodes.cut(b)
        assert not _reaches(a, b) and not _reaches(c, b) and not _reaches(b, a)
        assert _reaches(a, c) and _reaches(c, a)
    # closing killed the servers in the namespaces and removed everything it made
    assert all(p.poll() is not None for p in servers)
    names = ip("netns", "list").stdout
    assert not any(ns in names for ns in made)
    assert not any(n.veth in ip("link").stdout for n in nodes.nodes)

