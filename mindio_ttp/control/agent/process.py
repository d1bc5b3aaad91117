"""A node agent in a process of its own: what a rank starts when no launcher runs one.

ttprun's own process is its node's agent (launch/agent.py). Under another launcher (torchrun,
srun) the first rank of the node to find no agent starts this module as a child process, the way
rank 0 starts the controller process (control/controller/host.py): a fresh interpreter, in the
rank's
process group (a launcher's kill of the group ends it), SIGINT and SIGTERM ignored (they are the
ranks' to report), and it outlives the rank that started it. It holds the hop key only: the job
key is removed from its environment and the hop key comes over a socketpair, so the agent can
neither make nor alter an order (docs/design.md). It ends by itself once no rank and no agent
below has been connected for a while (the job ended, or every rank fell back to the controller).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from mindio_ttp.config import ENV_AUTH_KEY, ENV_AUTH_KEY_FILE, Deadlines
from mindio_ttp.control.agent.node import AgentSettings, NodeAgent
from mindio_ttp.log import setup_logging

log = logging.getLogger("mindio_ttp.agent")

START_TIMEOUT_S = 60.0
IDLE_EXIT_S = 2.0  # with no rank and no agent below this long, the node's job is over
_STARTED: List[subprocess.Popen] = []  # kept, so their exit status is collected


def settings_from_env(world_size: int, env: Optional[Dict[str, str]] = None) -> AgentSettings:
    """The agent's settings from the environment, as every rank and the controller read theirs
    (config.py's table): the agent judges its ranks by the same TTP_HEARTBEAT_TIMEOUT."""
    from mindio_ttp import config as C

    env = dict(os.environ if env is None else env)
    v = {name: C.value(env, name) for name in (
        C.ENV_HEARTBEAT_INTERVAL, C.ENV_HEARTBEAT_TIMEOUT, C.ENV_HANDSHAKE_TIMEOUT,
        C.ENV_CONNECT_TIMEOUT, C.ENV_OT, C.ENV_LISTEN_PORTS)}
    interval = v[C.ENV_HEARTBEAT_INTERVAL]
    timeout = v[C.ENV_HEARTBEAT_TIMEOUT]
    if not C._raw(env, C.ENV_HEARTBEAT_TIMEOUT):
        timeout = C.heartbeat_timeout_for(interval)  # the table's rule for an unset timeout
    local = env.get("LOCAL_WORLD_SIZE", "0")
    return AgentSettings(world_size, interval, timeout, v[C.ENV_HANDSHAKE_TIMEOUT],
                         v[C.ENV_CONNECT_TIMEOUT], v[C.ENV_OT],
                         int(local) if local.isdigit() else 0, v[C.ENV_LISTEN_PORTS])


class AgentProcess:
    def __init__(self, hop_key: bytes, path: str, world_size: int) -> None:
        self.hop_key, self.path, self.world_size = hop_key, path, world_size
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> str:
        """Start the agent and return once it listens at `path`; OSError when it cannot."""
        mine, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[3])
        env = {k: v for k, v in os.environ.items() if k not in (ENV_AUTH_KEY, ENV_AUTH_KEY_FILE)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", ""))
                                            if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mindio_ttp.control.agent", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        _STARTED.append(self.proc)
        try:
            mine.sendall(json.dumps({"hop_key": self.hop_key.hex(), "path": self.path,
                                     "world_size": self.world_size}).encode() + b"\n")
            mine.settimeout(START_TIMEOUT_S)
            line = b""
            while not line.endswith(b"\n"):
                chunk = mine.recv(4096)
                if not chunk:
                    break
                line += chunk
        except OSError as exc:
            raise OSError(f"the node agent did not start: {exc}") from None
        finally:
            mine.close()
        answer = json.loads(line or b"{}")
        if "listening" not in answer:
            raise OSError(f"the node agent did not start: {answer.get('error', 'no answer')}")
        log.info("started the node agent (pid %d) at %s", self.proc.pid, self.path)
        return self.path

    def kill(self) -> None:
        """It will serve no rank (the controller's port is not this job's): end it now."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def serve(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan = socket.socket(fileno=fd)
    raw = b""
    while not raw.endswith(b"\n"):
        chunk = chan.recv(65536)
        if not chunk:
            return 2
        raw += chunk
    p = json.loads(raw)
    setup_logging(0, label="node agent")
    try:
        settings = settings_from_env(int(p["world_size"]))
    except ValueError as exc:  # a bad setting: every rank refuses it too, with its name
        chan.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
        return 2
    agent = NodeAgent(bytes.fromhex(p["hop_key"]), settings, p["path"])
    try:
        agent.start()
    except OSError as exc:
        chan.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
        return 2
    chan.sendall(json.dumps({"listening": p["path"], "pid": os.getpid()}).encode() + b"\n")
    chan.close()
    return run(agent, settings)


def run(agent: NodeAgent, s: AgentSettings) -> int:
    """Serve until the node has had no rank and no agent below for a while."""
    idle_s = IDLE_EXIT_S
    never_s = Deadlines(s).agent_unjoined
    while agent._thread is not None and agent._thread.is_alive():
        time.sleep(0.2)
        now = time.monotonic()
        if agent.members:
            continue
        if agent.last_member_at is None and now - agent.started_at > never_s:
            break
        if agent.last_member_at is not None and now - agent.last_member_at > idle_s:
            break
    agent.stop()
    return 0
