"""Several "nodes" on one machine, for node-loss tests: network namespaces on one switch.

Each node is a network namespace whose only link is one end of a veth pair (node *i* has
``SUBNET.<i+1>``, no other route); the other end sits in a switch namespace of its own, on a
bridge, so every node reaches every other and the test can take any node's link down. Nothing
is added to the host's own namespace. A node runs one launcher (``ttprun``) started with
``ip netns exec``. A node is *lost* by freezing and then killing every process in its namespace
(``ip netns pids``: torch puts each worker in a session of its own, so one killpg would miss
them); a *silent* loss takes its link down first (no FIN, no RST reaches the others); a
*partition* takes links down and leaves every part running. ``block_port`` puts a firewall in
front of a node's port.

Everything made here (processes, namespaces, veth pairs, the bridge) is removed by
:meth:`Nodes.close`, which :func:`made_nodes` (and :func:`two_nodes`) calls also when the test
fails. Making namespaces needs root and iproute2: :func:`namespaces_unavailable` says why not,
for a skip. Every wait has a deadline and fails with every node's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Type, TypeVar

SUBNET = "10.213.0"
RUNS_PREFIX = "runs"  # <work>/runs<i>: node i's TTP_RUN_DIR parent


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (iproute2), bounded."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def namespaces_unavailable() -> Optional[str]:
    """None when this process can make network namespaces, else why not (a skip reason)."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"ttp-nlprobe-{secrets.token_hex(3)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@dataclass
class Node:
    """One namespace, its end of the link, and the launcher running in it."""

    index: int
    ns: str
    veth: str
    subnet: str = SUBNET
    proc: Optional[subprocess.Popen] = None
    lines: List[str] = field(default_factory=list)
    reader: Optional[threading.Thread] = None

    @property
    def addr(self) -> str:
        return f"{self.subnet}.{self.index + 1}"

    def output(self) -> str:
        return "\n".join(list(self.lines))

    def printed(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))


class NodeWaitError(AssertionError):
    """A bounded wait ran out; the message carries every node's output."""


class Nodes:
    """``count`` namespaces on one switch, and a launcher in each (see the module doc)."""

    def __init__(self, work: Path, count: int = 2, subnet: str = SUBNET) -> None:
        tag = secrets.token_hex(3)
        self.work = Path(work)
        self.nodes = [Node(i, f"ttp-nl{i}-{tag}", f"tnl{i}{tag}", subnet) for i in range(count)]
        self.switch = f"ttp-sw-{tag}"
        self.ckpt = self.work / "ckpt"  # the checkpoint directory every node shares
        self.cut_at: Optional[float] = None
        self._made: List[str] = []
        self._etc: List[Path] = []  # /etc/netns/<ns>/ made by launch(hostname=...)

    # -- set-up and tear-down ---------------------------------------------------------------
    def create(self) -> None:
        for ns in (self.switch, *(n.ns for n in self.nodes)):
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for n in self.nodes:
            port = "p" + n.veth  # the switch's end
            # made inside the switch namespace, so a failure half-way leaves nothing outside
            ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", n.veth)
            ip("-n", self.switch, "link", "set", n.veth, "netns", n.ns)
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")
            ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.veth)
            ip("-n", n.ns, "link", "set", n.veth, "up")

    def close(self) -> None:
        for n in self.nodes:
            if n.ns in self._made:
                self.kill(n)
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.kill()
            if n.proc is not None:
                n.proc.wait(10)
            if n.reader is not None:
                n.reader.join(5)
        for ns in self._made:
            ip("netns", "del", ns, check=False)  # veth pairs and the bridge go with them
        self._made.clear()
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
            with contextlib.suppress(OSError):
                etc.parent.rmdir()  # /etc/netns, if nothing else uses it
        self._etc.clear()

    # -- launching ----------------------------------------------------------------------------
    def run_dir(self, n: Node) -> Path:
        return self.work / f"{RUNS_PREFIX}{n.index}"

    def ttprun_args(self, n: Node, *, nproc: int, port: int, rdzv: str = "static",
                    rdzv_id: str = "ttp-node-loss", nnodes: Optional[int] = None,
                    rdzv_conf: Sequence[str] = ()) -> List[str]:
        """``ttprun`` arguments for node ``n`` of ``nnodes`` (default: all of them),
        rendezvous at node 0 on ``port``.

        c10d: node 0's agent hosts the rendezvous store (``is_host`` is given explicitly,
        torch's guess from host names does not see the namespace's address) and each agent
        names its own address (``--local-addr``) so its workers reach the agent that hosts the
        workers' store. ``rdzv_conf``: more ``key=value`` for ``--rdzv-conf``."""
        count = len(self.nodes) if nnodes is None else nnodes
        common = [f"--nnodes={count}", f"--nproc-per-node={nproc}", "--monitor-interval=0.05",
                  f"--rdzv-backend={rdzv}"]
        head = self.nodes[0].addr
        if rdzv == "static":
            return [*common, f"--master-addr={head}", f"--master-port={port}",
                    f"--node-rank={n.index}"]
        if rdzv == "c10d":
            conf = ",".join([f"is_host={'1' if n.index == 0 else '0'}", *rdzv_conf])
            return [*common, f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={rdzv_id}",
                    f"--rdzv-conf={conf}", f"--local-addr={n.addr}"]
        raise ValueError(f"rdzv={rdzv!r}: use 'static' or 'c10d'")

    def launch(self, n: Node, cmd: Sequence[str], env: Mapping[str, str],
               cwd: Optional[Path] = None, gloo_ifname: bool = True,
               hostname: Optional[str] = None) -> None:
        """Start ``cmd`` inside node ``n``'s namespace; its output is collected line by line.

        ``TTP_RUN_DIR`` is the node's own run directory, and gloo is told to use the node's
        link (it would resolve the host name to 127.0.0.1 otherwise) unless ``gloo_ifname`` is
        False. ``hostname``: the node gets that host name (its own UTS namespace) and an
        /etc/hosts of its own (``ip netns exec`` binds /etc/netns/<ns>/hosts over /etc/hosts)
        resolving it to 127.0.1.1, as Debian and Ubuntu do."""
        run_dir = self.run_dir(n)
        run_dir.mkdir(parents=True, exist_ok=True)
        env_n = dict(env, TTP_RUN_DIR=str(run_dir))
        if gloo_ifname:
            env_n["GLOO_SOCKET_IFNAME"] = n.veth
        if hostname is not None:
            etc = Path("/etc/netns") / n.ns
            etc.mkdir(parents=True, exist_ok=True)
            self._etc.append(etc)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n")
            cmd = ["unshare", "--uts", "--", "sh", "-c", f'hostname {hostname} && exec "$@"',
                   "sh", *cmd]
        n.proc = subprocess.Popen(["ip", "netns", "exec", n.ns, *cmd], env=env_n,
                                  cwd=None if cwd is None else str(cwd),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
        n.reader = threading.Thread(target=self._pump, args=(n,), daemon=True)
        n.reader.start()

    @staticmethod
    def _pump(n: Node) -> None:
        assert n.proc is not None and n.proc.stdout is not None
        for line in n.proc.stdout:
            n.lines.append(line.rstrip("\n"))

    # -- waiting ------------------------------------------------------------------------------
    def wait_until(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        """Poll ``done`` until it holds; fail after ``timeout`` or when every launcher ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return
            if all(n.proc is not None and n.proc.poll() is not None for n in self.nodes):
                if done():
                    return
                break
            time.sleep(0.05)
        raise NodeWaitError(f"{what} did not happen within {timeout:.0f} s; output:\n"
                            f"{self.outputs()}")

    def wait_for_line(self, n: Node, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if n.printed(text):
                return
            if n.proc is not None and n.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise NodeWaitError(f"node {n.index} never printed {text!r}; output:\n{self.outputs()}")

    def wait(self, n: Node, timeout: float) -> int:
        """The launcher's exit code; fail (the finalizer kills it) if it runs past ``timeout``."""
        assert n.proc is not None
        try:
            return n.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise NodeWaitError(f"node {n.index}'s launcher still runs after {timeout:.0f} s; "
                                f"output:\n{self.outputs()}") from None

    # -- faults -------------------------------------------------------------------------------
    def kill(self, n: Node) -> None:
        """Every process of the node at once: freeze them all (none can react to another's
        death), then SIGKILL them all, until the namespace holds no process."""
        for _ in range(20):
            pids = [int(p) for p in ip("netns", "pids", n.ns, check=False).stdout.split()]
            if not pids:
                return
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            time.sleep(0.05)

    def cut(self, *nodes: Node) -> None:
        """Take the links of ``nodes`` (default: every node) down on both ends: from now on
        nothing crosses them, not even a RST."""
        for n in nodes or self.nodes:
            ip("-n", n.ns, "link", "set", n.veth, "down")
            ip("-n", self.switch, "link", "set", "p" + n.veth, "down")
        self.cut_at = time.time()

    def block_port(self, n: Node, port: int, high: Optional[int] = None) -> None:
        """A firewall on node ``n`` dropping TCP to ``port`` (..``high``) that arrives over its
        link: connections from other nodes time out, as behind an INPUT DROP rule. Made with a
        policy-routing rule (kernel >= 4.17; no iptables needed): incoming packets meet it
        before the local table, which therefore moves behind it. The node's own connections
        (loopback) pass, as a firewall that admits ``lo`` lets them."""
        ports = str(port) if high is None else f"{port}-{high}"
        if not any(r for r in ip("-n", n.ns, "rule", "show", "pref", "100").stdout.split("\n")
                   if "lookup local" in r):
            ip("-n", n.ns, "rule", "add", "pref", "100", "lookup", "local")
            ip("-n", n.ns, "rule", "del", "pref", "0")
        ip("-n", n.ns, "rule", "add", "pref", "10", "iif", n.veth, "ipproto", "tcp", "dport",
           ports, "blackhole")

    # -- results ------------------------------------------------------------------------------
    def flow(self, n: Node) -> Optional[dict]:
        """The flow record (``flow-finished.json``) the runtime wrote on node ``n``, if any."""
        for path in sorted(self.run_dir(n).glob("*/flow-finished.json")):
            return json.loads(path.read_text(encoding="utf-8"))
        return None

    def flows(self) -> Dict[int, Optional[dict]]:
        return {n.index: self.flow(n) for n in self.nodes}

    def claims(self) -> List[dict]:
        """The fault claims in the shared checkpoint directory."""
        return [json.loads(p.read_text()) for p in sorted((self.ckpt / ".ttp-claims").glob("*"))]

    def outputs(self) -> str:
        return "\n".join(f"===== node {n.index} =====\n{n.output()}" for n in self.nodes)


TwoNodes = Nodes  # the two-node tests' name for it
T = TypeVar("T", bound=Nodes)


@contextlib.contextmanager
def made_nodes(work: Path, count: int = 2,
               kind: Type[T] = Nodes) -> Iterator[T]:  # type: ignore[assignment]
    """``count`` nodes made on entry, removed on exit (processes, namespaces, links, the
    bridge), also on failure."""
    nodes = kind(work, count)
    try:
        nodes.create()
        yield nodes
    finally:
        nodes.close()


def two_nodes(work: Path, kind: Type[T] = Nodes) -> contextlib.AbstractContextManager[T]:  # type: ignore[assignment]
    return made_nodes(work, 2, kind)
