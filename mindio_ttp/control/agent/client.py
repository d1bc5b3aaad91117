"""A rank's side of its node agent: find it (or start it), register through it, open envelopes.

ttprun tells its workers where its agent listens (TTP_AGENT_SOCKET). Under another launcher the
first rank of a node that finds no agent starts one (process.py), under a lock file, at a path
made from the job's hop key and the controller's address: the node's other ranks of the same
job find the same one, another job's ranks a different one.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import tempfile
import time
from typing import TYPE_CHECKING, List, Optional, Tuple

from mindio_ttp.config import ENV_AGENT_SOCKET
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import tier as T
from mindio_ttp.control.wire.session import RankHandshake
from mindio_ttp.control.wire.transport import ConnClosed, recv_messages

if TYPE_CHECKING:
    from mindio_ttp.control.agent.process import AgentProcess

log = logging.getLogger("mindio_ttp.agent")

START_LOCK_S = 30.0  # how long a rank waits for the node's first rank to start the agent


def local_ip_towards(host: str, port: int) -> str:
    """The address this host reaches `host` from (a UDP socket's route: nothing is sent): where a
    rank's standby listens when the rank itself reaches the controller through its agent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        info = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(info[0][4])
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def socket_dir() -> str:
    """A directory only this user can enter, for the node agents' sockets."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = os.path.join(base, f"ttp-agents-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{d} is not private to uid {os.getuid()} (mode 0700): remove it, or set "
                      "XDG_RUNTIME_DIR to a private directory")
    return d


def socket_path(hop_key: bytes, host: str, port: int, world_size: int) -> str:
    tag = hashlib.sha256(hop_key + f"|{host}|{port}|{world_size}".encode()).hexdigest()[:24]
    return os.path.join(socket_dir(), f"{tag}.sock")


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def find_or_start(hop_key: bytes, host: str, port: int, world_size: int,
                  start: bool = True) -> Tuple[Optional[str], Optional[AgentProcess]]:
    """(the socket of this node's agent for this job, the agent if this rank started it):
    TTP_AGENT_SOCKET (ttprun's), or the one a rank of this node started, or (`start`) one this
    rank starts now. None: no agent (the rank connects to the controller itself)."""
    given = os.environ.get(ENV_AGENT_SOCKET)
    if given:
        return given, None
    if not start:
        return None, None
    try:
        path = socket_path(hop_key, host, port, world_size)
    except OSError as exc:
        log.warning("no node agent: %s", exc)
        return None, None
    if _answers(path):
        return path, None
    from mindio_ttp.control.agent.process import AgentProcess

    deadline = time.monotonic() + START_LOCK_S
    with open(path[:-5] + ".lock", "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    return (path if _answers(path) else None), None
                time.sleep(0.05)
        try:
            if _answers(path):
                return path, None
            agent = AgentProcess(hop_key, path, world_size)
            try:
                agent.start()
            except OSError as exc:
                log.warning("cannot start a node agent (%s): this rank connects to the "
                            "controller itself", exc)
                return None, None
            return path, agent
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def probe(job_key: bytes, host: str, port: int, timeout: float) -> str:
    """What is wrong with the listener at host:port ('' when it sends this job's challenge, or
    does not take connections yet): the rank that starts its node's agent checks this once, so a
    port held by another program or another job's controller ends the ranks at once and says
    so (an agent holds no key to tell another job's controller from ours)."""
    try:
        sock = socket.create_connection((host, port), timeout=min(2.0, timeout))
    except OSError:
        return ""  # not listening yet: the agent keeps trying, as a rank would
    try:
        recv_messages(sock, RankHandshake(job_key).dec, timeout)
        return ""
    except TimeoutError:
        return f"no challenge within {timeout:g} s (TTP_HANDSHAKE_TIMEOUT)"
    except P.ProtocolError as exc:
        return str(exc)
    except (OSError, ConnClosed):
        return ""  # closed without a word: a busy listener making room (admission.py)
    finally:
        sock.close()


def connect(path: str, hop_key: bytes, reg: P.Register, upstream: T.Upstream,
            timeout: float) -> Tuple[socket.socket, RankHandshake, List[P.Message]]:
    """Register with the agent at `path`: the challenge, our Register and the controller's
    address, the agent's RegisterAck. Returns the socket, the handshake (keys, our nonce) and
    the frames that came behind the ack. OSError, ConnClosed, TimeoutError or ProtocolError
    when the agent does not answer as one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        hs = RankHandshake(hop_key, registry=T.CODEC)
        msgs = recv_messages(sock, hs.dec, timeout)
        sock.sendall(hs.answer(msgs[0], reg) + hs.tx.seal(upstream))
        msgs = recv_messages(sock, hs.dec, timeout)
    except (OSError, TimeoutError, ConnClosed, P.ProtocolError):
        sock.close()
        raise
    if not isinstance(msgs[0], P.RegisterAck):
        sock.close()
        raise P.ProtocolError(f"the node agent refused: {getattr(msgs[0], 'reason', msgs[0])}")
    return sock, hs, msgs[1:]


class AgentLink:
    """What a processor accepts from its node agent: hop-level acks and notices, and envelopes
    it opens itself (wire/envelope.py); a plain order from an agent is refused, since an
    agent holds no key that makes one."""

    HOP = "hop"  # an ack: nothing to do
    ORDER = "order"  # a verified order or verdict, new
    DUPLICATE = "duplicate"  # a verified one already accepted (see envelope.Inbox.open)
    LOST = "upstream lost"  # the agent lost its own parent: lock, as on a controller's loss
    REFUSED = "refused"

    def __init__(self, job_key: bytes, rank: int) -> None:
        from mindio_ttp.control.wire import envelope as E
        from mindio_ttp.control.wire import keys as K

        self.hop_key = K.hop_key(job_key)
        self.inbox = E.Inbox(K.order_key(job_key), rank, T.CODEC)
        self.refused = 0

    def classify(self, m: P.Message) -> Tuple[str, object]:
        from mindio_ttp.control.wire import envelope as E

        if isinstance(m, T.Sealed):
            status, inner, why = self.inbox.open(m.data)
            if status == E.REFUSED:
                self.refused += 1
                log.warning("rank %d: refused an envelope from the node agent: %s",
                            self.inbox.rank, why)
                return self.REFUSED, why
            return (self.ORDER if status == E.OK else self.DUPLICATE), inner
        if isinstance(m, T.UpstreamLost):
            return self.LOST, m.reason
        if isinstance(m, (P.HeartbeatAck, P.RegisterAck)):
            return self.HOP, None
        self.refused += 1
        log.error("rank %d: a %s from the node agent, not sealed by the controller: refused",
                  self.inbox.rank, type(m).__name__)
        return self.REFUSED, type(m).__name__
