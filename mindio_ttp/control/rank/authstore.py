"""`AuthStore`: a `torch.distributed.Store` whose keys live in the acting TTP controller.

Every operation is a `StoreRequest` frame over this rank's authenticated connection to the
controller (session keys, sequence numbers, HMAC: the same channel as the orders), answered by a
`StoreReply`; the controller keeps the keys per namespace (control/controller/keyspace.py). So a
rendezvous
on it is open to registered ranks only, bounded in memory, and needs no port of its own:

    store = AuthStore("ttp-save/<tag>", timedelta(seconds=90))
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)  # or ProcessGroupGloo
    dist.new_group(...)

It is the rendezvous of the dying checkpoint's gloo groups (the SaveOrder names the namespace,
save_session.py) and the fresh rendezvous a recovery re-creates process groups on.

Threads. torch calls a store from whatever thread builds a group (the main thread, a save
handler's thread, gloo's C++ threads through pybind's trampoline, which takes the GIL). A call
hands its request to the processor's thread (the only one that touches the socket) and waits on
an event, which releases the GIL, so the processor's thread runs meanwhile; the processor's own
thread never calls a store (it would wait for itself), and says so if it does. A call fails
with `DistStoreError` when the controller refuses it (budget, timeout), when no answer comes in
time, and at once when the connection to the controller is lost: a failover starts a new
controller with an empty store, so a rendezvous under way must be started again there.

torch's semantics are kept: `get` waits for the key (up to the store's timeout), `add` keeps a
decimal integer, `compare_set` is TCPStore's, `wait(keys, timeout)` takes its own timeout and a
zero timeout means "no timeout". Values are bytes; keys are strings.

Two things torch 2.13's trampoline for Python stores needs that its docs do not say: C++
callers (PrefixStore, gloo) look two methods up by their C++ names, `deleteKey` and
`getNumKeys`, so both spellings are defined; and the C++ side keeps only the C++ half of a
Python store alive, so once the Python object is collected every call fails with "Tried to call
pure virtual function" (`init_process_group(store=AuthStore(...))` with no other reference
would break at the next new_group). An AuthStore therefore keeps itself alive for the life of
the process; there are a few per process (one per save order or recovery), each small.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional, Protocol, Sequence, Union

import torch.distributed as dist

from mindio_ttp.config import Deadlines
from mindio_ttp.control.wire import protocol as P

# Past the operation's own timeout, how long a call waits for the controller's answer (the
# controller answers a timed-out wait itself; this covers a controller that stopped answering,
# until the processor declares it lost and fails the call).
Seconds = Union[float, timedelta]
_alive: List[AuthStore] = []  # see the module docstring: torch does not keep them alive


class Channel(Protocol):
    """What carries the requests: the rank's processor (processor.Processor.store_call)."""

    def store_call(self, request: P.StoreRequest, wait_s: float) -> P.StoreReply:
        """Send `request` (its `req` is assigned) and return the answer; raises
        `ConnectionError` when the connection is lost, `TimeoutError` after `wait_s`."""


_attached: Optional[Channel] = None  # this process's processor while it runs


def attach(channel: Channel) -> None:
    """The processor, once registered, makes itself the channel of every AuthStore made
    without one (it calls this: the store does not import the processor)."""
    global _attached
    _attached = channel


def detach(channel: Channel) -> None:
    global _attached
    if _attached is channel:
        _attached = None


def _seconds(t: Seconds) -> float:
    s = t.total_seconds() if isinstance(t, timedelta) else float(t)
    return P.MAX_SECONDS if s <= 0 else min(s, P.MAX_SECONDS)  # 0: no timeout, as in torch


class AuthStore(dist.Store):
    def __init__(self, namespace: str, timeout: Seconds = timedelta(seconds=300),
                 channel: Optional[Channel] = None) -> None:
        super().__init__()
        if not isinstance(namespace, str) or not P.NAMESPACE(namespace):
            raise ValueError(f"AuthStore namespace {namespace!r:.80}: use 1-128 characters of "
                             "A-Z a-z 0-9 . _ - / (not starting with /)")
        if channel is None:
            channel = _attached
            if channel is None:
                raise RuntimeError("AuthStore talks to the TTP controller through this "
                                   "process's processor: call ttp_start_processor first")
        self.namespace = namespace
        self._channel = channel
        self.set_timeout(timeout if isinstance(timeout, timedelta)
                         else timedelta(seconds=float(timeout)))
        _alive.append(self)

    # -- torch.distributed.Store ------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._call("set", [key], [_bytes(value)])

    def get(self, key: str) -> bytes:
        return P.b64decode(self._call("get", [key], timeout=self.timeout).values[0])

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key], amount=int(amount)).number

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        reply = self._call("compare_set", [key], [_bytes(expected_value), _bytes(desired_value)])
        return P.b64decode(reply.values[0])

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", list(keys)).number)

    def wait(self, keys: Sequence[str], timeout: Optional[timedelta] = None) -> None:
        self._call("wait", list(keys), timeout=self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", [key]).number)

    def num_keys(self) -> int:
        """The keys in this namespace (behind a PrefixStore too: all of the namespace's)."""
        return self._call("num_keys", []).number

    deleteKey = delete_key  # noqa: N815 - the names torch's C++ trampoline looks up
    getNumKeys = num_keys  # noqa: N815

    # -- internals ---------------------------------------------------------------------------------
    def _call(self, op: str, keys: List[str], values: Sequence[bytes] = (), amount: int = 0,
              timeout: Optional[Seconds] = None) -> P.StoreReply:
        wait_s = _seconds(self.timeout if timeout is None else timeout)
        request = P.StoreRequest(1, self.namespace, op, keys, [P.b64encode(v) for v in values],
                                 amount, wait_s)
        bad = P.problem(request)
        if bad:  # a key too long, too many keys, a value over 1 MiB: say so here
            raise ValueError(f"AuthStore {self.namespace!r}: {bad}")
        try:
            reply = self._channel.store_call(request, Deadlines.store_answer(wait_s))
        except (ConnectionError, TimeoutError) as exc:
            raise dist.DistStoreError(f"TTP store {self.namespace!r}: {op} {_keys(keys)}: "
                                      f"{exc}") from None
        if not reply.ok:
            raise dist.DistStoreError(f"TTP store {self.namespace!r}: {op} {_keys(keys)}: "
                                      f"{reply.error}")
        return reply


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _keys(keys: List[str]) -> str:
    return repr(keys[:4])[:200] + (f" (+{len(keys) - 4})" if len(keys) > 4 else "")
