"""Which network interface the workers' gloo groups use: the one on the route to MASTER_ADDR.

Every fault-time process group of the dying checkpoint is gloo (and a CPU job trains on gloo).
Without ``GLOO_SOCKET_IFNAME``, torch's gloo binds to the address the host's own name resolves
to (``ProcessGroupGloo::createDefaultDevice``), and Debian and Ubuntu resolve it to 127.0.1.1 by
default (``/etc/hosts``): each rank then tells its peers to connect to 127.0.1.1, which on
another node is that node itself, and every cross-node group fails to connect (on a dying
checkpoint: at the first exchange). So ttprun sets ``GLOO_SOCKET_IFNAME``, when the user has
not, to the interface this node uses to reach MASTER_ADDR (the rendezvous host, which every
node reaches), and says so. Where that route is the loopback interface on a multi-node job
(node 0 reaching its own name) it cannot tell which interface the peers reach, and says what
to set instead.

The interface: the one holding MASTER_ADDR when it is this node's own address (node 0: the
others reach it there), else the route's, ``ip -o route get ADDR`` (iproute2), else the source
address the kernel picks for a UDP socket connected to ADDR (no packet is sent) looked up among
this host's interfaces.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import subprocess
from typing import MutableMapping, Optional, Tuple

NAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def rendezvous_host(args) -> Optional[str]:
    """The host every node reaches, from torchrun's arguments: --master-addr (static), else
    the host of --rdzv-endpoint."""
    if getattr(args, "rdzv_backend", "static") == "static":
        return getattr(args, "master_addr", None) or None
    endpoint = (getattr(args, "rdzv_endpoint", "") or "").strip()
    if not endpoint:
        return None
    if endpoint.startswith("["):
        return endpoint[1:].split("]", 1)[0]
    return endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint


def _resolve(host: str) -> Optional[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as torch's store
    return infos[0][4][0] if infos else None


def _iproute(*args: str) -> str:
    try:
        out = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def _via_iproute(ip: str) -> Optional[str]:
    words = _iproute("route", "get", ip).split()
    return words[words.index("dev") + 1] if "dev" in words[:-1] else None


def _source_address(ip: str) -> Optional[str]:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # UDP: picks the route and source address, sends nothing
            return s.getsockname()[0]
    except OSError:
        return None


def _interface_with(address: str) -> Optional[str]:
    """The interface holding `address` on this host, or None (iproute2; else IPv4: each
    interface's address by ioctl, IPv6: /proc/net/if_inet6)."""
    words = _iproute("addr", "show", "to", address).split()
    if len(words) > 1:
        return words[1].rstrip(":").split("@")[0]
    if ":" in address:
        want = ipaddress.IPv6Address(address.split("%")[0]).exploded.replace(":", "")
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if fields and fields[0] == want:
                        return fields[-1]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def route_interface(host: str) -> Tuple[Optional[str], bool, str]:
    """(interface, is loopback, why not) for the route from this node to `host`."""
    ip = _resolve(host)
    if ip is None:
        return None, False, f"cannot resolve {host!r}"
    loopback = ipaddress.ip_address(ip.split("%")[0]).is_loopback
    # MASTER_ADDR is this host's own (node 0): the interface holding it is the one the other
    # nodes reach it through (the kernel's route to one's own address is the loopback device)
    name = None if loopback else _interface_with(ip)
    name = name or _via_iproute(ip)
    if name is None:
        source = _source_address(ip)
        name = _interface_with(source) if source else None
        loopback = loopback or (source is not None
                                and ipaddress.ip_address(source.split("%")[0]).is_loopback)
    if name is None:
        return None, loopback, f"no route to {host} ({ip}) found"
    return name, loopback or name == "lo", ""


def choose(environ: MutableMapping[str, str], host: Optional[str],
           multi_node: bool) -> Tuple[Optional[str], str]:
    """(value to set, or None; what to tell the user, or "")."""
    if environ.get(NAME):
        return None, ""
    if not host:
        return None, ""
    name, loopback, why = route_interface(host)
    if name is None:
        return None, (f"warning: {why}: gloo will bind to the address of this host's name, which "
                      f"other nodes may not reach; export {NAME}=<the interface to the other "
                      "nodes>")
    if loopback and multi_node:
        return None, (f"warning: MASTER_ADDR {host} is reached through the loopback interface "
                      f"{name} here, so the interface the other nodes reach is unknown: export "
                      f"{NAME}=<that interface> (or use an address of this node the others "
                      "reach as MASTER_ADDR)")
    return name, (f"{NAME}={name} (the interface of the route to MASTER_ADDR {host}) for the "
                  f"workers' gloo groups; export {NAME} to choose another")
