"""The NCCL-like process group: torch.distributed's own backend registration, gloo underneath,
and NCCL's failure behaviour on top (docs/rehearsal.md, "Collectives that spin").

How "blocks like NCCL" is made true on gloo:

* **The op runs on gloo, the result is ours.** Each collective copies its tensors into staging
  tensors and hands those to the group's ``ProcessGroupGloo`` (non-blocking: gloo queues it).
  The group's *completion thread* (its "NCCL stream") waits for gloo's works in issue order;
  on success it copies the staging tensors back into the caller's and marks the op done. So
  results complete in order, after the host call returned, and a gloo op still running after
  an abort never writes into the caller's tensors.
* **A gloo error is never seen.** When gloo fails an op (a dead peer's connection reset), the
  group starts *spinning*: that op and every later one of the group stay unfinished, as an NCCL
  kernel waiting for a dead peer does, until the group is aborted (or its watchdog acts). The
  member that saw it says so in the group's store (``SPIN_KEY``), and the others' groups spin
  too once they read it (`watchdog`: their gloo ops may wait for a live member that left the op,
  which gloo never reports). A SIGSTOPped peer makes gloo wait until its own timeout, set far
  away (``GLOO_TIMEOUT``): nobody knows it spins.
* **The host.** ``Work.wait()`` enqueues "wait for this op" on the calling thread's current
  fake-device stream (what NCCL's wait does), then blocks the host until the op is done, or
  fails (an abort, the watchdog: it raises), or is known to spin: then it returns, as NCCL's
  wait always does, and the host runs on until it reads device memory (``.item()``,
  ``bool(t)``, ``torch.save``, a stream or device ``synchronize``), which waits behind the
  stream and so blocks. A CPU host cannot run ahead of an op that may still finish (the next
  op would read a result not yet there), hence the block until then. ``barrier()`` blocks the
  host in every case (NCCL's barrier synchronizes the device).
* **Abort** (under this release's names, `versions`), from any thread: every unfinished op of
  the group ends with ``DistBackendError``, its stream waits complete (the stream moves on),
  and later ops raise at once.
* **The communicator** (the gloo group) is made at the group's first collective, in the
  calling thread, blocking and not abortable, as torch's lazy NCCL initialisation in blocking
  mode: a peer lost before it is reached leaves that thread there for good. A gloo group is
  never destroyed (its destructor would join threads a hung op holds), nor is an NCCL-like
  group (`_keep_forever`): they stay, leaked, for the life of the process.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import DistBackendError

from testkit.nccl_like import device as fake_device
from testkit.nccl_like.versions import (
    CLEAN_UP_ONLY,
    NO_HANDLING,
    SKIP_CLEAN_UP,
    TEAR_DOWN,
    Emulated,
)

NAME = "nccl_like"
WAIT_BLOCKS_HOST = False  # NCCL_LIKE_WAIT=block: wait() blocks until the op ends, spinning or not
GLOO_TIMEOUT = datetime.timedelta(days=7)
SPIN_KEY = "nccl_like_spinning"  # in the group's store: a member's gloo saw a dead peer
BREAK_TAG = 2**30 + 7  # a p2p tag no caller uses: `_break_pairs`
WorkResult = torch._C._distributed_c10d.WorkResult


class _Internal(threading.local):
    """Set while torch's own destroy_process_group runs: the names a release lacks are visible
    then (torch 2.13's destroy calls ``shutdown()`` on every group)."""

    active = False


INTERNAL = _Internal()


class _Hidden:
    """A method this release's ProcessGroupNCCL lacks: ``hasattr`` says False (outside
    torch's own destroy)."""

    def __init__(self, name: str, real: Callable[..., Any]) -> None:
        self.name, self.real = name, real

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None or INTERNAL.active:
            return self.real.__get__(obj, owner)
        raise AttributeError(f"'{type(obj).__name__}' object has no attribute '{self.name}' "
                             f"(the NCCL backend of the emulated torch has none)")


class _Op:
    """One collective: its staging, completion and outcome."""

    def __init__(self, group: NcclLikeGroup, kind: str, seq: int, host_blocking: bool) -> None:
        self.group, self.kind, self.seq = group, kind, seq
        self.host_blocking = host_blocking
        self.issued = time.monotonic()
        self.finished = threading.Event()  # done, or ended by an error
        self.settled = threading.Event()  # finished, or known to spin
        self.error: Optional[BaseException] = None
        self.result: Optional[Any] = None  # WorkResult once the watchdog would know it
        self.result_future: Optional[torch.futures.Future] = None
        self.future: Optional[torch.futures.Future] = None
        self.outputs: Any = None
        self.copy_back: Callable[[], None] = lambda: None
        self.gloo_work: Any = None

    def describe(self) -> str:
        timeout_ms = int(self.group.timeout.total_seconds() * 1000)
        return (f"WorkNCCL(SeqNum={self.seq}, OpType={self.kind.upper()}, "
                f"Timeout(ms)={timeout_ms})")

    def end(self, error: Optional[BaseException], result: Optional[Any]) -> None:
        """Called once, under the group's lock."""
        self.error = error
        if result is not None:
            self.result = result
            if self.result_future is not None and not self.result_future.done():
                self.result_future.set_result(result)
        if self.future is not None and not self.future.done():
            if error is None:
                self.future.set_result(self.outputs)
            else:
                self.future.set_exception(error)
        self.finished.set()
        self.settled.set()


class NcclLikeWork(dist.distributed_c10d.Work):
    """What a collective returns at once (module doc: the host)."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: Any = None) -> bool:
        op = self._op
        if not op.finished.is_set():
            fake_device.current_stream().enqueue(op.finished.wait)
        seconds = _seconds(timeout)
        if seconds is not None:  # NCCL's wait(timeout) polls the host until then
            if not op.finished.wait(seconds):
                raise DistBackendError(f"[Rank {op.group.rank()}] {op.describe()} was not "
                                       f"complete after the wait's timeout of {seconds:g} s")
        elif op.host_blocking or WAIT_BLOCKS_HOST:
            op.finished.wait()
        else:
            op.settled.wait()
        if op.error is not None:
            raise op.error
        return True

    def synchronize(self) -> None:
        """The current stream waits for the op; the host does not."""
        if not self._op.finished.is_set():
            fake_device.current_stream().enqueue(self._op.finished.wait)

    def is_completed(self) -> bool:
        return self._op.finished.is_set()

    def is_success(self) -> bool:
        return self._op.finished.is_set() and self._op.error is None

    def exception(self) -> Optional[BaseException]:
        return self._op.error

    def source_rank(self) -> int:
        return -1

    def result(self) -> List[torch.Tensor]:
        return list(self._op.outputs or [])

    def get_future(self) -> torch.futures.Future:
        op = self._op
        with op.group._lock:
            if op.future is None:
                op.future = torch.futures.Future()
                if op.finished.is_set():
                    if op.error is None:
                        op.future.set_result(op.outputs)
                    else:
                        op.future.set_exception(op.error)
        return op.future

    def _get_future_result(self) -> torch.futures.Future:
        """WorkResult once known: SUCCESS when done, TIMEOUT or COMM_ERROR when the watchdog
        ended it; never after a user abort (torch's watchdog stops checking then)."""
        op = self._op
        with op.group._lock:
            if op.result_future is None:
                op.result_future = torch.futures.Future()
                if op.result is not None:
                    op.result_future.set_result(op.result)
        return op.result_future


def _seconds(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout)
    return seconds if seconds > 0 else None


_GROUPS: weakref.WeakSet[NcclLikeGroup] = weakref.WeakSet()
_KEPT: List[Any] = []  # never destroyed: these groups, their gloo groups, unfinished gloo works


def _keep_forever(obj: Any) -> None:
    """One reference nothing ever drops, not even the interpreter's shutdown. A gloo group's
    destructor joins its threads, which a hung op holds until gloo's timeout. A c10d object (a
    ProcessGroup, a Work: their pybind holders release and retake the GIL to destroy them, and
    a work's staging tensors retake it too) must not die in a daemon thread while the
    interpreter finalizes: retaking the GIL then ends the thread with a forced unwind through
    C++ destructors, std::terminate, SIGABRT (seen at the end of runs after a recovery: a
    completion thread, ending, dropped the last reference to its aborted group, and before
    that to a gloo work). So every NCCL-like group is kept; a gloo work that finished is
    dropped by the completion thread before its op ends (the host still waits on it then), and
    one that never finished is kept here."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _KEPT.append(obj)


def _bury(ops: Sequence[_Op]) -> None:
    """Keep the gloo works of `ops`, which never finished, for good (`_keep_forever`)."""
    works = [op.gloo_work for op in ops if op.gloo_work is not None]
    for op in ops:
        op.gloo_work = None
    if works:
        _KEPT.append(works)


class NcclLikeGroup(dist.ProcessGroup):
    """A process group with NCCL's failure behaviour (module doc). `emulated` says which
    release's names and defaults it has; `make_class` builds the class for one release."""

    emulated: Emulated
    work_class: type = NcclLikeWork

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        self.timeout = timeout
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._gloo: Any = None
        self._gloo_failed = ""
        self._seq = 0
        self._pending: Deque[_Op] = deque()  # unfinished, in issue order
        self._to_complete: Deque[_Op] = deque()  # handed to gloo, not yet seen by the thread
        self._wake = threading.Condition(self._lock)
        self._aborted = ""  # why, once aborted
        self._spinning = ""  # the gloo error that made it spin, once it spins
        self._spinning_since = 0.0
        self._completer: Optional[threading.Thread] = None
        self.error_handling, self.error_handling_source = self.emulated.error_handling()
        self.name_in_logs = f"nccl_like group of {size} (rank {rank})"
        _GROUPS.add(self)
        _keep_forever(self)  # its completion thread must not be the one to destroy it
        from testkit.nccl_like import watchdog

        watchdog.ensure_running()

    # -- identity ---------------------------------------------------------------------------
    def name(self) -> str:
        return "nccl"

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "nccl"

    def _get_backend_name(self) -> str:
        return "nccl"

    # -- abort, shutdown ---------------------------------------------------------------------
    def _abort_now(self, why: str = "aborted by the user") -> None:
        """End every unfinished op with an error; later ops raise at once."""
        error = DistBackendError(f"[Rank {self.rank()}] NCCL communicator was aborted on rank "
                                 f"{self.rank()} ({why}).")
        with self._lock:
            if self._aborted:
                return
            self._aborted = why
            pending = list(self._pending)
            self._pending.clear()
            _bury(pending)
            for op in pending:
                op.end(error, None)
            self._wake.notify_all()
        if pending and self._gloo is not None:
            self._break_pairs()

    def _break_pairs(self) -> None:
        """Close every gloo connection of the group, so that whatever gloo still waits for fails
        now and the completion thread leaves gloo's ``wait()`` before this process can exit.

        Why: ``wait()`` blocks in C++ with the GIL released. A daemon thread still blocked
        there when the interpreter finalizes (an aborted group's op, hung for good) returns when
        a peer's exit closes the socket, and CPython then ends it with a forced unwind through
        pybind11's frames: std::terminate, SIGABRT, at the end of a run that went well (seen
        after in-memory recoveries). How: a recv with a 1 ms timeout on a tag nothing uses times
        out, and gloo then closes that pair. The peers' gloo ops with this rank fail: their
        groups spin, as they would on NCCL, where an aborted rank never answers again."""
        for peer in range(self.size()):
            if peer == self.rank():
                continue
            try:
                work = self._gloo.recv([torch.empty(1)], peer, BREAK_TAG)
                _KEPT.append(work)  # never destroyed in a daemon thread (_keep_forever)
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the expected timeout (or a pair already gone)
                pass

    def _abort(self) -> None:
        self._abort_now()

    def _shutdown(self) -> None:
        self._abort_now()

    def abort(self) -> None:
        self._abort_now()

    def _group_start(self) -> None:
        """NCCL's group call around several aborts (2.5+); nothing to batch here."""

    def _group_end(self) -> None:
        """See `_group_start`."""

    def shutdown(self) -> None:
        """Graceful (2.6+): wait for the unfinished work, unless aborted; then the
        communicator is gone. Before 2.6 (torch's destroy only): the group is dropped and its
        communicators aborted."""
        if self.emulated.graceful_shutdown:
            while True:
                with self._lock:
                    if self._aborted or not self._pending:
                        break
                    last = self._pending[-1]
                last.finished.wait()
        self._abort_now("destroyed")

    # -- ops ---------------------------------------------------------------------------------
    def _ensure_gloo(self) -> Any:
        """The communicator, made at the first collective (module doc)."""
        if self._gloo is not None:
            return self._gloo
        with self._init_lock:
            if self._gloo is None and not self._gloo_failed:
                try:
                    gloo = dist.ProcessGroupGloo(dist.PrefixStore("nccl_like/", self._store),
                                                 self.rank(), self.size(), GLOO_TIMEOUT)
                except Exception as exc:  # noqa: BLE001 - NCCL's init would hang: so do we
                    self._gloo_failed = f"{type(exc).__name__}: {exc}"
                else:
                    _keep_forever(gloo)
                    self._gloo = gloo
        if self._gloo is None:
            print(f"[nccl_like rank {self.rank()}] communicator initialisation cannot finish "
                  f"({self._gloo_failed}): blocked, as ncclCommInitRank would be", flush=True,
                  file=sys.stderr)
            threading.Event().wait()
        return self._gloo

    def _issue(self, kind: str, start: Callable[[Any], Any], outputs: Any = None,
               copy_back: Callable[[], None] = lambda: None,
               host_blocking: bool = False) -> NcclLikeWork:
        """Hand one op to gloo (`start(gloo)` returns gloo's work) and return its Work."""
        self._raise_if_aborted(kind)
        gloo = self._ensure_gloo()
        with self._lock:
            self._raise_if_aborted(kind)
            self._seq += 1
            op = _Op(self, kind, self._seq, host_blocking)
            op.outputs, op.copy_back = outputs, copy_back
            self._pending.append(op)
            if self._spinning:
                op.settled.set()  # behind a spinning op: it never runs either
                return self.work_class(op)  # type: ignore[no-any-return]
            op.gloo_work = start(gloo)  # raises at once for what gloo refuses
            self._to_complete.append(op)
            if self._completer is None:
                self._completer = threading.Thread(target=self._complete, daemon=True,
                                                   name=f"nccl-like-stream-{id(self):x}")
                self._completer.start()
            self._wake.notify_all()
        return self.work_class(op)

    def _raise_if_aborted(self, kind: str) -> None:
        if self._aborted:
            raise DistBackendError(f"[Rank {self.rank()}] NCCL communicator was aborted on "
                                   f"rank {self.rank()} ({self._aborted}); {kind} cannot run "
                                   "on it.")

    def _complete(self) -> None:
        """The group's stream: gloo's works, in issue order (module doc)."""
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._to_complete or self._aborted)
                if self._aborted:
                    return
                op = self._to_complete.popleft()
            try:
                error = _await(op.gloo_work, lambda: bool(self._aborted or self._spinning))
            except _GaveUp:
                return
            with self._lock:
                if self._aborted or self._spinning or op.finished.is_set():
                    return  # a peer said it spins first: the host may have run on already
                if error is None:
                    op.gloo_work = None  # destroyed here, while the host waits (_keep_forever)
                    try:
                        op.copy_back()
                        failed: Optional[BaseException] = None
                    except Exception as exc:  # noqa: BLE001 - the host's to see, not this thread's
                        failed = exc
                    op.copy_back = _nothing
                    self._pending.remove(op)
                    op.end(failed, None if failed else WorkResult.SUCCESS)
                    op = None
                    continue
            self.start_spinning(f"{op.describe()}: gloo: {type(error).__name__}: "
                                f"{str(error)[:200]}", seen_here=True)
            return

    def start_spinning(self, why: str, seen_here: bool) -> None:
        """From now on no op of the group finishes (until aborted): every waiter's host may
        run on. `seen_here`: this rank's gloo saw the dead peer, so it tells the other members
        through the group's store (their gloo ops may wait on a live member forever)."""
        with self._lock:
            if self._spinning or self._aborted:
                return
            self._spinning = why
            self._spinning_since = time.monotonic()
            self._to_complete.clear()
            for waiting in self._pending:
                waiting.settled.set()
        print(f"[nccl_like rank {self.rank()}] spinning until aborted ({why})",
              file=sys.stderr, flush=True)
        if seen_here:
            try:
                self._store.set(SPIN_KEY, why[:200])
            except Exception:  # noqa: BLE001 - best effort: the others then block in wait()
                pass

    def peer_says_spinning(self) -> bool:
        """Whether another member saw a dead peer (the watchdog's peer watcher asks)."""
        try:
            return bool(self._store.check([SPIN_KEY]))
        except Exception:  # noqa: BLE001 - a store that cannot answer says nothing
            return False

    # -- the collectives torch.distributed calls on a ProcessGroup -----------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        staged = [t.clone() for t in tensors]
        return self._issue("allreduce", lambda g: g.allreduce(staged, opts), list(tensors),
                           _copier(tensors, staged))

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor],
                            opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        staged = [t.clone() for t in tensors]
        return self._issue("allreduce_coalesced", lambda g: g.allreduce_coalesced(staged, opts),
                           list(tensors), _copier(tensors, staged))

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        staged = [t.clone() for t in tensors]
        return self._issue("broadcast", lambda g: g.broadcast(staged, opts), list(tensors),
                           _copier(tensors, staged))

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        staged = [t.clone() for t in tensors]
        return self._issue("reduce", lambda g: g.reduce(staged, opts), list(tensors),
                           _copier(tensors, staged))

    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
                  input_tensors: Sequence[torch.Tensor], opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        outs = [[torch.empty_like(t) for t in row] for row in output_tensors]
        ins = [t.clone() for t in input_tensors]
        flat_real = [t for row in output_tensors for t in row]
        return self._issue("allgather", lambda g: g.allgather(outs, ins, opts),
                           [list(row) for row in output_tensors],
                           _copier(flat_real, [t for row in outs for t in row]))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        out, inp = torch.empty_like(output), input.clone()
        return self._issue("_allgather_base", lambda g: g._allgather_base(out, inp, opts),
                           [output], _copier([output], [out]))

    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor],
                                    inputs: Sequence[torch.Tensor],
                                    opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        outs = [torch.empty_like(t) for t in outputs]
        ins = [t.clone() for t in inputs]
        return self._issue("allgather_coalesced", lambda g: _All(
            [g._allgather_base(o, i, opts) for o, i in zip(outs, ins)]), list(outputs),
            _copier(outputs, outs))

    def reduce_scatter(self, output_tensors: Sequence[torch.Tensor],
                       input_tensors: Sequence[Sequence[torch.Tensor]],
                       opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outs = [torch.empty_like(t) for t in output_tensors]
        ins = [[t.clone() for t in row] for row in input_tensors]
        return self._issue("reduce_scatter", lambda g: g.reduce_scatter(outs, ins, opts),
                           list(output_tensors), _copier(output_tensors, outs))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        out, inp = torch.empty_like(output), input.clone()
        return self._issue("_reduce_scatter_base",
                           lambda g: g._reduce_scatter_base(out, inp, opts), [output],
                           _copier([output], [out]))

    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor],
                                        inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        outs = [torch.empty_like(t) for t in outputs]
        ins = [t.clone() for t in inputs]
        return self._issue("reduce_scatter_coalesced", lambda g: _All(
            [g._reduce_scatter_base(o, i, opts) for o, i in zip(outs, ins)]), list(outputs),
            _copier(outputs, outs))

    def gather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
               input_tensors: Sequence[torch.Tensor], opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.GatherOptions()
        outs = [[torch.empty_like(t) for t in row] for row in output_tensors]
        ins = [t.clone() for t in input_tensors]
        return self._issue("gather", lambda g: g.gather(outs, ins, opts),
                           [list(row) for row in output_tensors],
                           _copier([t for row in output_tensors for t in row],
                                   [t for row in outs for t in row]))

    def scatter(self, output_tensors: Sequence[torch.Tensor],
                input_tensors: Sequence[Sequence[torch.Tensor]],
                opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        outs = [torch.empty_like(t) for t in output_tensors]
        ins = [[t.clone() for t in row] for row in input_tensors]
        return self._issue("scatter", lambda g: g.scatter(outs, ins, opts),
                           list(output_tensors), _copier(output_tensors, outs))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: List[int], input_split_sizes: List[int],
                      opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        out, inp = torch.empty_like(output), input.clone()
        return self._issue("alltoall_base", lambda g: g.alltoall_base(
            out, inp, output_split_sizes, input_split_sizes, opts), [output],
            _copier([output], [out]))

    def alltoall(self, output_tensors: Sequence[torch.Tensor],
                 input_tensors: Sequence[torch.Tensor], opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        outs = [torch.empty_like(t) for t in output_tensors]
        ins = [t.clone() for t in input_tensors]
        return self._issue("alltoall", lambda g: g.alltoall(outs, ins, opts),
                           list(output_tensors), _copier(output_tensors, outs))

    # torch 2.13's names for the flat-tensor collectives (older Python called the others)
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> NcclLikeWork:
        staged = [t.clone() for t in tensors]
        return self._issue("send", lambda g: g.send(staged, dst, tag), [])

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> NcclLikeWork:
        staged = [torch.empty_like(t) for t in tensors]
        return self._issue("recv", lambda g: g.recv(staged, src, tag), list(tensors),
                           _copier(tensors, staged))

    def barrier(self, opts: Any = None) -> NcclLikeWork:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._issue("barrier", lambda g: g.barrier(opts), [], host_blocking=True)

    # -- what the watchdog reads -------------------------------------------------------------
    def oldest_pending(self) -> Optional[_Op]:
        with self._lock:
            return self._pending[0] if self._pending and not self._aborted else None

    def waiting_since(self) -> float:
        """When the oldest unfinished op of a group not (yet) known to spin was issued (0:
        none): the peer watcher asks the store about such groups."""
        with self._lock:
            if self._spinning or self._aborted or not self._pending:
                return 0.0
            return self._pending[0].issued

    def spinning_since(self) -> float:
        """When a gloo error made the group spin (0: it does not)."""
        return self._spinning_since if self._spinning and not self._aborted else 0.0

    def watchdog_ends(self, op: _Op, error: BaseException, result: Any) -> None:
        """The watchdog's abort (modes 1, 2): `op` ends with `error`, the rest as aborted."""
        with self._lock:
            if op.finished.is_set() or self._aborted:
                return
            self._pending.remove(op)
            op.end(error, result)
        self._abort_now(f"by the watchdog: {error}")


class _GaveUp(Exception):  # noqa: N818 - a signal, not an error
    """The group was aborted (or spins) while its completion thread waited: stop waiting."""


def _await(work: Any, stop: Callable[[], bool]) -> Optional[BaseException]:
    """Wait for a gloo work: its error or None; `_GaveUp` when `stop()` says the group was
    aborted (or spins) meanwhile. (``wait()`` it must be: gloo's send, recv and reduce-scatter
    works say neither ``is_completed()`` nor a future before it.)"""
    try:
        work.wait()
        error = None
    except Exception as exc:  # noqa: BLE001 - a dead peer (or an abort): spin, never raise
        error = exc
    if stop():
        raise _GaveUp()
    return error


class _All:
    """Several gloo works as one (a coalesced op)."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self.works)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def _nothing() -> None:
    pass


def _copier(real: Sequence[torch.Tensor], staged: Sequence[torch.Tensor]) -> Callable[[], None]:
    def copy_back() -> None:
        with torch.no_grad():  # what a collective writes is no autograd op (Megatron's p2p
            for dst, src in zip(real, staged):  # receives into leaves that require grad)
                dst.copy_(src)

    return copy_back


def make_class(emulated: Emulated) -> type:
    """NcclLikeGroup with `emulated`'s names: the others raise AttributeError (`_Hidden`);
    its works have ``get_future_result`` from 2.6 only."""
    work_attrs: dict = {"__module__": __name__}
    if emulated.has_future_result:
        work_attrs["get_future_result"] = NcclLikeWork._get_future_result
    else:
        work_attrs["get_future_result"] = _Hidden("get_future_result",
                                                  NcclLikeWork._get_future_result)
    work_class = type(f"WorkNCCLLike{emulated.minor}", (NcclLikeWork,), work_attrs)
    attrs: dict = {"emulated": emulated, "work_class": work_class, "__module__": __name__}
    for name in emulated.hidden_names():
        attrs[name] = _Hidden(name, getattr(NcclLikeGroup, name))
    return type(f"ProcessGroupNCCLLike{emulated.minor}", (NcclLikeGroup,), attrs)


def live_groups() -> List[NcclLikeGroup]:
    return list(_GROUPS)


def error_mode_name(mode: int) -> str:
    return {NO_HANDLING: "0 (no handling)", TEAR_DOWN: "1 (abort and tear down)",
            CLEAN_UP_ONLY: "2 (abort only)", SKIP_CLEAN_UP: "3 (tear down, no abort)"}.get(
                mode, str(mode))


def pid_tag() -> str:
    return f"{os.getpid()}"
