"""``ttprun --check``: a pre-flight check of every node, with the arguments of the real launch.

Run on every node as the real launch would be (same torchrun arguments, same training command,
``--check`` added), it starts no worker. The nodes meet through the launch's own rendezvous
(static: the store on MASTER_ADDR:MASTER_PORT; c10d: the endpoint), each opens the listeners
the job will need and every node tries them, and every node prints the same table:

* the rendezvous store: reached by every node (a node that cannot is named, with the port);
* the controller port on MASTER_ADDR (``TTP_CONTROLLER_PORT``, else the patched tree's
  ``port = N`` in megatron/training.py, else 8000): free on node 0 and reached from every node;
* the standby listeners (``TTP_LISTEN_PORTS`` or ephemeral ports) on each node's address:
  reached from the other nodes;
* the gloo / NCCL / HCCL interface (``GLOO_SOCKET_IFNAME`` as ttprun would set it,
  ``NCCL_SOCKET_IFNAME``, ``HCCL_SOCKET_IFNAME``/``HCCL_IF_IP``): an address of that interface
  that the other nodes reach, not a loopback one;
* the clocks: node 0's time read over the controller port, against each node's own, within
  `CLOCK_LIMIT_S` (logs of different nodes then line up);
* the checkpoint directory (Megatron's ``--save``): writable on every node, shared (every node
  sees the files the others wrote), with room for one checkpoint (the newest one there, or an
  estimate from the model's arguments);
* the settings that must agree: the key (compared by a digest, never sent), ``TTP_OT``,
  ``TTP_RECOVERY``, the controller port, ``TTP_LISTEN_PORTS``, ranks per node, the training
  arguments and this package's version.

Exit 0 when every check passed, 1 when one failed (each failure says what to open or set).
Beyond 32 nodes each node tries node 0's listeners and those of the 16 nodes after it (a ring),
so the cost stays linear in the number of nodes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mindio_ttp import __version__, config
from mindio_ttp.launch import gloo_iface
from mindio_ttp.launch.outcome import CheckpointArgs

CONNECT_TIMEOUT_S = 3.0  # one probe of one listener
JOIN_TIMEOUT_S = 60.0  # how long a node waits for the others (--rdzv-conf timeout/join_timeout)
CLOCK_LIMIT_S = 0.5  # clocks further apart than this make the nodes' logs misleading
RING = 16  # beyond 2 * RING nodes, each node tries node 0 and the RING nodes after it
DEFAULT_CONTROLLER_PORT = 8000
PREFIX = "ttp-check/"
OK, FAIL, NOTE = "ok", "FAIL", "-"


@dataclass
class Row:
    check: str
    result: str
    detail: str


@dataclass
class Listener:
    """A TCP listener that answers every connection with this host's time (8 bytes)."""

    sock: socket.socket
    addr: str
    port: int
    thread: Optional[threading.Thread] = None

    @classmethod
    def open(cls, addr: str, ports: Sequence[int]) -> Listener:
        last: Optional[OSError] = None
        for port in ports:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((addr, port))
                sock.listen(128)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            listener = cls(sock, addr, sock.getsockname()[1])
            listener.thread = threading.Thread(target=listener._serve, daemon=True,
                                               name="ttp-check-listener")
            listener.thread.start()
            return listener
        assert last is not None
        raise last

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(struct.pack("!d", time.time()))
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def probe(addr: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> Tuple[Optional[float],
                                                                           float, str]:
    """(clock offset of the listener's host against ours, round trip s, error): connects,
    reads the listener's time. The offset is its time minus the middle of our round trip."""
    sent = time.time()
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            data = b""
            while len(data) < 8:
                chunk = sock.recv(8 - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        return None, time.time() - sent, f"{why} after {time.time() - sent:.1f} s"
    back = time.time()
    if len(data) != 8:
        return None, back - sent, "closed before answering (not our listener?)"
    return struct.unpack("!d", data)[0] - (sent + back) / 2, back - sent, ""


# -- what this node knows about itself ------------------------------------------------------------
def controller_port(env: Dict[str, str], script: str) -> Tuple[int, str]:
    """The controller's port and where it comes from."""
    port = config.value(env, config.ENV_CONTROLLER_PORT)
    if port is not None:
        return port, config.ENV_CONTROLLER_PORT
    training = Path(script).resolve().parent / "megatron" / "training.py" if script else None
    if training is not None and training.is_file():
        text = training.read_text(encoding="utf-8", errors="replace")
        at = text.find("ttp_start_controller")
        found = re.findall(r"^\s*port\s*=\s*(\d+)\s*$", text[:at] if at >= 0 else "", re.M)
        if found:
            return int(found[-1]), f"{training.parent.parent.name}/megatron/training.py"
    return DEFAULT_CONTROLLER_PORT, "the guide's default"


def interface_address(name: str) -> Optional[str]:
    """An IPv4 address of interface `name` (NCCL's prefix match: the first interface whose
    name starts with it, unless it begins with '='); None when there is none."""
    exact = name.startswith("=")
    name = name.lstrip("=^").split(",")[0]
    for _, ifname in socket.if_nameindex():
        if ifname == name or (not exact and ifname.startswith(name)):
            addr = _ipv4_of(ifname)
            if addr:
                return addr
    return None


def _ipv4_of(ifname: str) -> Optional[str]:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def collective_interfaces(env: Dict[str, str]) -> List[Tuple[str, str, Optional[str]]]:
    """[(library, interface or address as set, address)] the workers' collectives will use."""
    out = []
    gloo = env.get(gloo_iface.NAME)
    if gloo:
        out.append(("gloo", f"{gloo_iface.NAME}={gloo}", interface_address(gloo)))
    else:
        host = socket.gethostname()
        out.append(("gloo", f"the address of host name {host}", _resolve(host)))
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl:
        out.append(("NCCL", f"NCCL_SOCKET_IFNAME={nccl}", interface_address(nccl)))
    hccl_ip = env.get("HCCL_IF_IP")
    hccl = env.get("HCCL_SOCKET_IFNAME")
    if hccl_ip:
        out.append(("HCCL", f"HCCL_IF_IP={hccl_ip}", hccl_ip))
    elif hccl:
        out.append(("HCCL", f"HCCL_SOCKET_IFNAME={hccl}", interface_address(hccl)))
    return out


def _resolve(host: str) -> Optional[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    return infos[0][4][0] if infos else None


def _is_loopback(addr: Optional[str]) -> bool:
    import ipaddress

    try:
        return addr is not None and ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def key_digest(env: Dict[str, str]) -> Optional[str]:
    """A digest of the job key that says whether two nodes hold the same key and nothing
    about it (HMAC of a fixed text under the key); None: no key (ttprun makes one per node)."""
    try:
        key = config.auth_key_from_env(env)
    except ValueError:
        return None
    return hmac.new(key, b"ttprun --check", hashlib.sha256).hexdigest()[:16]


def checkpoint_size(save: Path, script_args: Sequence[str]) -> Tuple[Optional[int], str]:
    """Bytes one checkpoint takes: the newest one in `save` when there is one, else an
    estimate from Megatron's model arguments (None when neither is possible)."""
    tracker = save / "latest_checkpointed_iteration.txt"
    try:
        text = tracker.read_text(encoding="ascii").strip()
        newest = save / f"iter_{int(text):07d}"
        if newest.is_dir():
            size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
            return size, f"the size of {newest.name}"
    except (OSError, ValueError):
        pass
    args = [str(a) for a in script_args]

    def num(flag: str) -> Optional[int]:
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args) and args[i + 1].isdigit():
                return int(args[i + 1])
            if a.startswith(flag + "=") and a.split("=", 1)[1].isdigit():
                return int(a.split("=", 1)[1])
        return None

    layers, hidden = num("--num-layers"), num("--hidden-size")
    if not layers or not hidden:
        return None, "unknown (no checkpoint there yet, no --num-layers/--hidden-size)"
    seq = num("--max-position-embeddings") or num("--seq-length") or 2048
    ffn = num("--ffn-hidden-size") or 4 * hidden
    vocab = 50304  # GPT-2's 50257, padded as Megatron does
    params = vocab * hidden + seq * hidden + layers * (4 * hidden * hidden + 2 * hidden * ffn
                                                       + 9 * hidden + ffn) + 2 * hidden
    half = "--fp16" in args or "--bf16" in args
    # the model file (fp16/bf16 or fp32 weights) and the optimizer's fp32 main params, exp_avg
    # and exp_avg_sq, spread over the DP ranks' files
    return params * ((2 if half else 4) + 12), (f"estimated from the model's arguments: "
                                                 f"~{params / 1e6:.0f}M parameters")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- the check itself -----------------------------------------------------------------------------
@dataclass
class Context:
    """What the check needs from the launch's arguments."""

    nnodes: int
    nproc_per_node: str
    rdzv_backend: str
    endpoint: str  # host:port of the store
    node_rank: Optional[int]  # static only
    rdzv_configs: Dict[str, Any]
    run_id: str
    local_addr: Optional[str]
    script: str
    script_args: List[str]
    env: Dict[str, str] = field(default_factory=lambda: dict(os.environ))

    @classmethod
    def from_args(cls, args: Any) -> Context:
        from torch.distributed.run import _parse_rendezvous_config, get_rdzv_endpoint

        nnodes = str(args.nnodes).split(":")[-1]
        return cls(int(nnodes), str(args.nproc_per_node), args.rdzv_backend,
                   get_rdzv_endpoint(args),
                   args.node_rank if args.rdzv_backend == "static" else None,
                   _parse_rendezvous_config(args.rdzv_conf), args.rdzv_id,
                   getattr(args, "local_addr", None), args.training_script,
                   [str(a) for a in args.training_script_args])

    @property
    def join_timeout(self) -> float:
        for name in ("join_timeout", "timeout"):
            if name in self.rdzv_configs:
                return float(self.rdzv_configs[name])
        return JOIN_TIMEOUT_S

    @property
    def store_host(self) -> Tuple[str, int]:
        host, _, port = self.endpoint.rpartition(":")
        return host.strip("[]"), int(port)


class NodeCheck:
    """One node's part: meet the others, open listeners, probe theirs, report, print."""

    def __init__(self, ctx: Context, say: Callable[[str], None] = print) -> None:
        self.ctx = ctx
        self.say = say
        self.store: Any = None
        self.rank = -1
        self.world = ctx.nnodes
        self.listeners: List[Listener] = []
        self.rows: List[Row] = []

    # -- meeting ------------------------------------------------------------------------------
    def _meet(self) -> Optional[str]:
        """Join the rendezvous; None, or why not (a failure row)."""
        ctx = self.ctx
        host, port = ctx.store_host
        started = time.monotonic()
        if ctx.rdzv_backend == "static":
            from torch.distributed import TCPStore

            hosting = ctx.node_rank == 0
            if not hosting:
                deadline = time.monotonic() + ctx.join_timeout
                while True:
                    _, _, why = probe_tcp(host, port)
                    if not why:
                        break
                    if time.monotonic() >= deadline:
                        return (f"this node (node {ctx.node_rank}) cannot reach the rendezvous "
                                f"store {host}:{port} ({why}, tried for {ctx.join_timeout:.0f} "
                                f"s): start node 0 first, and open TCP port {port} on {host} "
                                "to the other nodes (--master-port)")
                    time.sleep(0.5)
            try:
                self.store = TCPStore(host, port, None, hosting,
                                      timedelta(seconds=ctx.join_timeout),
                                      wait_for_workers=False, multi_tenant=True)
            except Exception as exc:  # noqa: BLE001 - DistNetworkError, RuntimeError
                what = (f"node 0 cannot listen on {host}:{port}" if hosting
                        else f"cannot join the store at {host}:{port}")
                return (f"{what} ({str(exc).splitlines()[0][:160]}): "
                        + ("is another job or a stale ttprun using --master-port? Is "
                           "--master-addr an address of this node?" if hosting else
                           "check --master-addr and --master-port"))
            self.rank = int(ctx.node_rank or 0)
        else:
            from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

            params = RendezvousParameters(backend=ctx.rdzv_backend, endpoint=ctx.endpoint,
                                          run_id=f"{ctx.run_id}-ttp-check", min_nodes=ctx.nnodes,
                                          max_nodes=ctx.nnodes, local_addr=ctx.local_addr,
                                          **ctx.rdzv_configs)
            try:
                handler = registry.get_rendezvous_handler(params)
                info = handler.next_rendezvous()
            except Exception as exc:  # noqa: BLE001 - RendezvousTimeoutError, ...
                return (f"the {ctx.rdzv_backend} rendezvous at {ctx.endpoint} failed "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}): start "
                        "ttprun --check on every node with the same --nnodes, --rdzv-id and "
                        f"--rdzv-endpoint, and open TCP port {port} on {host}")
            store, rank, world = (info.store, info.rank, info.world_size) if hasattr(
                info, "store") else info
            self.store, self.rank, self.world = store, int(rank), int(world)
        self.joined_s = time.monotonic() - started
        return None

    def _put(self, key: str, value: Dict[str, Any]) -> None:
        self.store.set(PREFIX + key, json.dumps(value))

    def _get_all(self, what: str, timeout: float) -> Dict[int, Dict[str, Any]]:
        """Every node's `what` record; missing nodes are absent from the answer."""
        out: Dict[int, Dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        for node in range(self.world):
            key = f"{PREFIX}{what}/{node}"
            left = max(0.1, deadline - time.monotonic())
            try:
                self.store.wait([key], timedelta(seconds=left))
                out[node] = json.loads(self.store.get(key).decode())
            except Exception:  # noqa: BLE001 - a timeout: that node is missing
                continue
        return out

    # -- this node ----------------------------------------------------------------------------
    def _reachable_address(self) -> Optional[str]:
        """The address the other nodes reach this node at: ours on the route to the store."""
        host, port = self.ctx.store_host
        ip = _resolve(host) or host
        if self.ctx.local_addr:
            return _resolve(self.ctx.local_addr) or self.ctx.local_addr
        try:
            with socket.create_connection((ip, port), timeout=CONNECT_TIMEOUT_S) as s:
                return s.getsockname()[0]
        except OSError:
            return None

    def _info(self) -> Dict[str, Any]:
        env = self.ctx.env
        addr = self._reachable_address()
        info: Dict[str, Any] = {"host": socket.gethostname(), "addr": addr, "listen": {},
                                "problems": []}
        ports = config.value(env, config.ENV_LISTEN_PORTS)
        standby_ports = list(range(ports[0], ports[1] + 1)) if ports else [0]
        if addr:
            try:
                self.listeners.append(Listener.open(addr, standby_ports))
                info["listen"]["standby"] = [addr, self.listeners[-1].port]
            except OSError as exc:
                info["problems"].append(
                    f"standby listeners: cannot listen on {addr} "
                    f"({'every port of ' + config.ENV_LISTEN_PORTS if ports else 'a port'}: "
                    f"{exc.strerror}): widen {config.ENV_LISTEN_PORTS}")
        info["ifaces"] = []
        for lib, how, iaddr in collective_interfaces(env):
            entry = {"lib": lib, "how": how, "addr": iaddr}
            if iaddr and not _is_loopback(iaddr):
                try:
                    listener = Listener.open(iaddr, [0])
                    self.listeners.append(listener)
                    entry["port"] = listener.port
                except OSError as exc:
                    entry["error"] = f"cannot listen on {iaddr}: {exc.strerror}"
            info["ifaces"].append(entry)
        port, source = controller_port(env, self.ctx.script)
        info["controller_port"], info["controller_port_source"] = port, source
        if self.rank == 0:
            where = self.ctx.store_host[0] if self.ctx.rdzv_backend == "static" else ""
            bind = (_resolve(where) or where) if where else ""
            try:
                self.listeners.append(Listener.open(bind, [port]))
                info["listen"]["controller"] = [bind or addr, port]
            except OSError as exc:
                info["problems"].append(
                    f"controller port: node 0 cannot listen on {bind or '*'}:{port} "
                    f"({exc.strerror}): another program holds it, or MASTER_ADDR is not an "
                    f"address of node 0; set {config.ENV_CONTROLLER_PORT} to a free port "
                    "(the same on every node)")
        info["settings"] = {
            "key": key_digest(env),
            config.ENV_OT: f"{config.value(env, config.ENV_OT):g}",
            config.ENV_RECOVERY: config.value(env, config.ENV_RECOVERY),
            "controller port": port,
            config.ENV_LISTEN_PORTS: env.get(config.ENV_LISTEN_PORTS, ""),
            "ranks per node": self.ctx.nproc_per_node,
            "training arguments": hashlib.sha256(
                "\0".join([Path(self.ctx.script).name, *self.ctx.script_args]).encode()
            ).hexdigest()[:12],
            "ttp-patch": __version__,
        }
        return info

    def _checkpoint_write(self, token: str) -> Dict[str, Any]:
        save = CheckpointArgs.parse(self.ctx.script_args).save
        if save is None:
            return {"dir": None}
        path = Path(save)
        out: Dict[str, Any] = {"dir": str(path)}
        try:
            path.mkdir(parents=True, exist_ok=True)
            mine = path / f".ttp-check-{token}-node{self.rank}"
            with open(mine, "wb") as f:
                f.write(os.urandom(4096))
                f.flush()
                os.fsync(f.fileno())
            out["wrote"] = mine.name
            out["free"] = shutil.disk_usage(path).free
        except OSError as exc:
            out["error"] = f"{exc.strerror or exc} ({path})"
        return out

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        why = self._meet()
        if why is not None:
            self.rows = [Row("rendezvous store", FAIL, why)]
            self._print()
            return 1
        try:
            return self._run_joined()
        finally:
            for listener in self.listeners:
                listener.close()

    def _run_joined(self) -> int:
        timeout = self.ctx.join_timeout
        token = ""
        if self.rank == 0:
            token = secrets.token_hex(4)
            self._put("token", {"token": token})
        info = self._info()
        self._put(f"info/{self.rank}", info)
        infos = self._get_all("info", timeout)
        if self.rank != 0:
            token = self._get_all_one("token", timeout).get("token", "x")
        probes = self._probe_everyone(infos)
        ckpt = self._checkpoint_write(token)
        probes["ckpt"] = ckpt
        self._put(f"probe/{self.rank}", probes)
        results = self._get_all("probe", timeout)
        seen = self._checkpoint_seen(ckpt, results)
        self._put(f"seen/{self.rank}", seen)
        seens = self._get_all("seen", timeout)
        if ckpt.get("wrote"):
            (Path(ckpt["dir"]) / ckpt["wrote"]).unlink(missing_ok=True)
        self._put(f"done/{self.rank}", {})  # the listeners stay up until every node is done
        self._get_all("done", timeout)
        self.rows = judge(self.world, infos, results, seens, self.ctx)
        self._print()
        return 0 if all(r.result != FAIL for r in self.rows) else 1

    def _get_all_one(self, key: str, timeout: float) -> Dict[str, Any]:
        try:
            self.store.wait([PREFIX + key], timedelta(seconds=timeout))
            return json.loads(self.store.get(PREFIX + key).decode())
        except Exception:  # noqa: BLE001
            return {}

    def _peers(self) -> List[int]:
        if self.world <= 2 * RING:
            return [n for n in range(self.world) if n != self.rank]
        return sorted({0, *((self.rank + k) % self.world for k in range(1, RING + 1))}
                      - {self.rank})

    def _probe_everyone(self, infos: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        """Try node 0's controller port and every peer's listeners, in parallel."""
        jobs: List[Tuple[str, int, str, int]] = []  # (what, node, addr, port)
        head = infos.get(0, {})
        if "controller" in head.get("listen", {}):
            addr, port = head["listen"]["controller"]
            jobs.append(("controller", 0, addr, port))
        for node in self._peers():
            peer = infos.get(node)
            if peer is None:
                continue
            if "standby" in peer["listen"]:
                jobs.append(("standby", node, *peer["listen"]["standby"]))
            for entry in peer.get("ifaces", []):
                if entry.get("port"):
                    jobs.append((entry["lib"], node, entry["addr"], entry["port"]))
        out: Dict[str, Any] = {"failed": [], "clock": None}
        lock = threading.Lock()

        def one(job: Tuple[str, int, str, int]) -> None:
            what, node, addr, port = job
            offset, rtt, why = probe(addr, port)
            with lock:
                if why:
                    out["failed"].append([what, node, addr, port, why])
                elif what == "controller":
                    out["clock"] = [offset, rtt]

        threads = [threading.Thread(target=one, args=(job,), daemon=True) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CONNECT_TIMEOUT_S + 5)
        return out

    def _checkpoint_seen(self, ckpt: Dict[str, Any],
                         results: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        if not ckpt.get("dir") or not ckpt.get("wrote"):
            return {}
        folder = Path(ckpt["dir"])
        missing = [node for node, r in results.items() if r.get("ckpt", {}).get("wrote")
                   and not (folder / r["ckpt"]["wrote"]).is_file()]
        return {"missing": missing}

    def _print(self) -> None:
        ctx = self.ctx
        self.say(f"ttprun --check: node {self.rank if self.rank >= 0 else ctx.node_rank} of "
                 f"{self.world}, {ctx.nproc_per_node} rank(s) per node, {ctx.rdzv_backend} "
                 f"rendezvous at {ctx.endpoint}")
        width = max(len(r.check) for r in self.rows)
        self.say(f"  {'check':<{width}}  result  detail")
        for r in self.rows:
            self.say(f"  {r.check:<{width}}  {r.result:<6}  {r.detail}")
        failed = [r.check for r in self.rows if r.result == FAIL]
        self.say(f"ttprun --check: {len(failed)} check(s) failed ({', '.join(failed)}): exit 1"
                 if failed else "ttprun --check: every check passed: exit 0")


# -- the verdict (pure: every node computes the same table from the same records) ---------------
def judge(world: int, infos: Dict[int, Dict[str, Any]], probes: Dict[int, Dict[str, Any]],
          seens: Dict[int, Dict[str, Any]], ctx: Context) -> List[Row]:
    rows: List[Row] = []
    host, port = ctx.store_host
    missing = [n for n in range(world) if n not in infos]
    if missing:
        rows.append(Row("rendezvous store", FAIL, f"node(s) {missing} never reported within "
                        f"{ctx.join_timeout:.0f} s: start `ttprun --check` with the same "
                        f"arguments on every node; each must reach {host}:{port}"))
    else:
        rows.append(Row("rendezvous store", OK, f"every node ({world}) reached {host}:{port}"))
    failed = [f for node in sorted(probes) for f in _tagged(node, probes[node]["failed"])]
    problems = {n: i.get("problems", []) for n, i in infos.items()}

    # controller
    head = infos.get(0, {})
    cport = head.get("controller_port", "?")
    source = head.get("controller_port_source", "")
    ctl_fail = [f for f in failed if f[1] == "controller"]
    ctl_problem = [p for p in problems.get(0, []) if p.startswith("controller port")]
    ctl_addr = head.get("listen", {}).get("controller", [host, cport])[0] or host
    if ctl_problem:
        rows.append(Row(f"controller port {cport}", FAIL, ctl_problem[0]))
    elif ctl_fail:
        nodes = sorted({f[0] for f in ctl_fail})
        rows.append(Row(f"controller port {cport}", FAIL,
                        f"node(s) {nodes} cannot connect to {ctl_addr}:{cport} "
                        f"({ctl_fail[0][5]}): open TCP port {cport} on node 0 ({ctl_addr}) to "
                        f"every node, or set {config.ENV_CONTROLLER_PORT} to a port that is open "
                        "(the same on every node)"))
    elif 0 in infos:
        rows.append(Row(f"controller port {cport}", OK,
                        f"node 0 listens on {ctl_addr}:{cport} ({source}); every node reached "
                        "it"))

    # standby listeners
    sb_problem = [(n, p) for n, ps in problems.items() for p in ps if p.startswith("standby")]
    sb_fail = [f for f in failed if f[1] == "standby"]
    ranged = ctx.env.get(config.ENV_LISTEN_PORTS)
    if sb_problem:
        rows.append(Row("standby listeners", FAIL, f"node {sb_problem[0][0]}: {sb_problem[0][1]}"))
    elif sb_fail:
        f = sb_fail[0]
        rows.append(Row("standby listeners", FAIL,
                        f"node {f[0]} cannot connect to node {f[2]}'s {f[3]}:{f[4]} ({f[5]})"
                        + (f" and {len(sb_fail) - 1} more" if len(sb_fail) > 1 else "")
                        + (f": open {config.ENV_LISTEN_PORTS}={ranged} between the nodes" if ranged
                           else ": they use ephemeral ports; set "
                           f"{config.ENV_LISTEN_PORTS}=LOW-HIGH and open that range between "
                           "the nodes")))
    elif world > 1:
        rows.append(Row("standby listeners", OK,
                        f"every node reached its peers' ({ranged or 'ephemeral ports'})"))

    # collective interfaces
    libs = sorted({e["lib"] for i in infos.values() for e in i.get("ifaces", [])})
    for lib in libs:
        bad = []
        for node, info in sorted(infos.items()):
            for e in info.get("ifaces", []):
                if e["lib"] != lib:
                    continue
                if e.get("addr") is None:
                    bad.append(f"node {node}: {e['how']} has no IPv4 address")
                elif _is_loopback(e["addr"]) and world > 1:
                    bad.append(f"node {node}: {e['how']} is {e['addr']}, a loopback address the "
                               "other nodes cannot reach")
                elif e.get("error"):
                    bad.append(f"node {node}: {e['error']}")
        lib_fail = [f for f in failed if f[1] == lib]
        hint = {"gloo": f"set {gloo_iface.NAME}", "NCCL": "set NCCL_SOCKET_IFNAME",
                "HCCL": "set HCCL_SOCKET_IFNAME (or HCCL_IF_IP)"}[lib]
        if bad:
            rows.append(Row(f"{lib} interface", FAIL, f"{bad[0]}: {hint} to the interface "
                            "the nodes reach each other through, on every node"))
        elif lib_fail:
            f = lib_fail[0]
            rows.append(Row(f"{lib} interface", FAIL,
                            f"node {f[0]} cannot connect to node {f[2]}'s {lib} address "
                            f"{f[3]} ({f[5]}): {hint} to the interface the nodes reach each "
                            "other through"))
        else:
            shown = ", ".join(
                f"node {n} {e['addr']} ({e['how']})" for n, i in sorted(infos.items())
                for e in i.get("ifaces", []) if e["lib"] == lib)
            rows.append(Row(f"{lib} interface", OK, shown + (
                ", each reached from the others" if world > 1 else "")))

    # clocks
    offsets = {n: p["clock"][0] for n, p in probes.items() if p.get("clock")}
    if offsets:
        worst = max(offsets, key=lambda n: abs(offsets[n]))
        skew = abs(offsets[worst])
        if skew > CLOCK_LIMIT_S:
            rows.append(Row("clocks", FAIL, f"node {worst}'s clock is {offsets[worst]:+.3f} s "
                            f"off node 0's (more than {CLOCK_LIMIT_S:g} s: the nodes' log lines "
                            "will not line up): run NTP (chrony, systemd-timesyncd) on every "
                            "node"))
        else:
            rows.append(Row("clocks", OK, f"largest offset from node 0: {skew * 1000:.0f} ms "
                            f"(node {worst}), within {CLOCK_LIMIT_S * 1000:.0f} ms"))

    # checkpoint directory
    rows.append(_checkpoint_row(probes, seens, ctx))

    # settings
    settings = {n: i.get("settings", {}) for n, i in infos.items()}
    differ = []
    names = sorted({k for s in settings.values() for k in s})
    for name in names:
        values = {n: s.get(name) for n, s in settings.items()}
        if len(set(map(str, values.values()))) > 1:
            if name == "key":
                differ.append("the key (TTP_AUTH_KEY / TTP_AUTH_KEY_FILE) differs between "
                              "nodes" if all(values.values()) else
                              f"no key on node(s) {[n for n, v in values.items() if not v]}")
            else:
                shown = ", ".join(f"node {n}: {v}" for n, v in sorted(values.items()))
                differ.append(f"{name} ({shown})")
    if world > 1 and any(s.get("key") is None for s in settings.values()) and not differ:
        differ.append("no key: a multi-node job needs TTP_AUTH_KEY (or TTP_AUTH_KEY_FILE) on "
                      "every node")
    if differ:
        rows.append(Row("settings agree", FAIL, "; ".join(differ) + ": give every node the "
                        "same"))
    elif settings:
        s = next(iter(settings.values()))
        rows.append(Row("settings agree", OK,
                        f"the same key, {config.ENV_OT}={s.get(config.ENV_OT)}, "
                        f"{config.ENV_RECOVERY}={s.get(config.ENV_RECOVERY)}, controller port "
                        f"{s.get('controller port')}, ranks per node, training arguments and "
                        f"version on every node"))
    return rows


def _tagged(node: int, failed: List[List[Any]]) -> List[Tuple[Any, ...]]:
    """(prober node, what, target node, addr, port, why)."""
    return [(node, f[0], f[1], f[2], f[3], f[4]) for f in failed]


def _checkpoint_row(probes: Dict[int, Dict[str, Any]], seens: Dict[int, Dict[str, Any]],
                    ctx: Context) -> Row:
    ckpts = {n: p.get("ckpt", {}) for n, p in probes.items()}
    dirs = {c.get("dir") for c in ckpts.values()}
    name = "checkpoint directory"
    if dirs == {None} or not dirs:
        return Row(name, NOTE, "no --save in the training command: nothing to check")
    where = sorted(d for d in dirs if d)[0]
    errors = [(n, c["error"]) for n, c in sorted(ckpts.items()) if c.get("error")]
    if errors:
        return Row(name, FAIL, f"node {errors[0][0]} cannot write there: {errors[0][1]}: make "
                   "--save a directory every node can write (the same path on a filesystem "
                   "every node mounts)")
    unseen = {n: s.get("missing") for n, s in sorted(seens.items()) if s.get("missing")}
    if unseen:
        node, missing = next(iter(unseen.items()))
        return Row(name, FAIL, f"{where} is not shared: node {node} does not see what node(s) "
                   f"{missing} wrote there: put --save on a filesystem every node mounts (the "
                   "dying checkpoint's savers are on several nodes)")
    size, how = checkpoint_size(Path(where), ctx.script_args)
    free = min((c.get("free", 0) for c in ckpts.values()), default=0)
    if size is not None and free < size:
        return Row(name, FAIL, f"{where}: {_gib(free)} free, one checkpoint needs ~{_gib(size)} "
                   f"({how}): free some space or point --save elsewhere")
    room = f"room for one checkpoint of ~{_gib(size)} ({how})" if size is not None else \
        f"checkpoint size {how}"
    return Row(name, OK, f"{where}: writable and shared by every node; {_gib(free)} free, "
               f"{room}")


def probe_tcp(host: str, port: int) -> Tuple[None, float, str]:
    """Only whether something accepts connections at host:port (the store, before joining)."""
    started = time.time()
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None, time.time() - started, ""
    except OSError as exc:
        why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        return None, time.time() - started, why


def run_check(args: Any, env: Dict[str, str]) -> int:
    """``ttprun --check``: the exit code (0 every check passed, 1 one failed). `env`: the
    workers' environment as ttprun would give it (GLOO_SOCKET_IFNAME included)."""
    ctx = Context.from_args(args)
    ctx.env = dict(env)
    return NodeCheck(ctx, say=lambda line: print(line, file=sys.stdout, flush=True)).run()
