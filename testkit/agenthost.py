"""Real node agents (control/agent/node.py) hosted in a helper process (testkit/forking.py), for
tests and benches: a node of simulated ranks needs a real agent to register through, and a bench
needs real relays (node agents the controller sends other agents to) without a process per node.

Each agent listens on its own AF_UNIX socket in a private directory, exactly as in production;
the host process only starts them, answers `status`, and stops them (`close`).
"""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from mindio_ttp.control.agent.node import AgentSettings, NodeAgent
from mindio_ttp.control.wire.keys import hop_key
from testkit.forking import clean_context


def _main(conn: Any, key: bytes, settings: AgentSettings, n: int, directory: str,
          controller: Optional[Tuple[str, int]], cpus: Optional[set]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
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
    """`n` node agents in a forked process. `controller`: they register with it at once (the
    bench's relays); otherwise each waits for its first rank to name the controller."""

    def __init__(self, key: bytes, settings: AgentSettings, n: int,
                 controller: Optional[Tuple[str, int]] = None,
                 cpus: Optional[set] = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ttp-agents-")  # mkdtemp: 0700, ours
        ctx = clean_context()
        self._pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_main, daemon=True,
                                args=(theirs, key, settings, n, self.dir, controller, cpus))
        self.proc.start()
        theirs.close()
        if not self._pipe.poll(60):
            self.close()
            raise TimeoutError("the node agents did not start within 60 s")
        self.paths: List[str] = self._pipe.recv()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> List[Dict[str, Any]]:
        self._pipe.send("status")
        if not self._pipe.poll(30):
            raise TimeoutError("node agents: no status")
        return self._pipe.recv()

    def close(self) -> None:
        try:
            self._pipe.send("stop")
            self._pipe.poll(10)
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for f in os.listdir(self.dir):
            try:
                os.unlink(os.path.join(self.dir, f))
            except OSError:
                pass
        os.rmdir(self.dir)
