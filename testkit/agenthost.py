"""Real node agents (control/agent/node.py) hosted in a helper process (testkit/forking.py), for
tests and benches: a node of simulated ranks needs a real agent to register through, and a bench
needs real relays (node agents the controller sends other agents to) without a process per node.

Each agent listens on its own AF_UNIX socket in a private directory, exactly as in production;
the host process only starts them, answers `status`, and stops them (`close`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from mindio_ttp.control.agent.node import AgentSettings, NodeAgent
from mindio_ttp.control.wire.keys import hop_key
from testkit.forking import Helper, helper_setup


def _main(conn: Any, key: bytes, settings: AgentSettings, n: int, directory: str,
          controller: Optional[Tuple[str, int]], cpus: Optional[set]) -> None:
    helper_setup(cpus)
    agents: List[NodeAgent] = []
    for i in range(n):
        a = NodeAgent(hop_key(key), settings, os.path.join(directory, f"agent-{i}.sock"),
                      name=f"node agent {i}")
        a.start()
        if controller is not None:
            a.use_controller(*controller)
        agents.append(a)
    conn.send([a.path for a in agents])
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd == "status":
            conn.send([a.status() for a in agents])
        elif cmd == "stop":
            break
    for a in agents:
        a.stop()
    conn.send(True)


class AgentHost:
    """`n` node agents in a helper process. `controller`: they register with it at once (the
    bench's relays); otherwise each waits for its first rank to name the controller."""

    def __init__(self, key: bytes, settings: AgentSettings, n: int,
                 controller: Optional[Tuple[str, int]] = None,
                 cpus: Optional[set] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ttp-agents-")  # mkdtemp: 0700, ours
        try:
            self._helper = Helper(_main, (key, settings, n, self.dir, controller, cpus),
                                  "the node agents", 60)
        except BaseException:
            self._remove_dir()
            raise
        self.proc = self._helper.proc
        self.paths: List[str] = self._helper.first

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> List[Dict[str, Any]]:
        return self._helper.ask("status", 30)

    def close(self) -> None:
        self._helper.close(grace=10)
        self._remove_dir()

    def _remove_dir(self) -> None:
        for f in os.listdir(self.dir):
            try:
                os.unlink(os.path.join(self.dir, f))
            except OSError:
                pass
        os.rmdir(self.dir)
