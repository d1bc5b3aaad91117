"""`ttprun`: torchrun with a grace period for the dying checkpoint.

Stock torchrun kills every surviving worker as soon as one fails (SIGTERM inside the same poll,
SIGKILL 30 s later) and gives a preempted launcher the same 30 s. A dying checkpoint needs the
survivors alive until the TTP runtime has chosen a step, saved it and renamed it. `ttprun` takes
torchrun's arguments unchanged (torch's own parser) and runs torch's own launch code; the only
difference is the agent, a `LocalElasticAgent` subclass that:

* on a worker failure keeps the survivors running for up to ``TTP_OT`` seconds, and stops waiting
  as soon as ``$TTP_RUN_DIR/flow-finished.json`` exists and every live worker has exited
  (a stopped, i.e. SIGSTOPped, worker never exits: it is killed once the flow has finished);
* on SIGTERM to the launcher (preemption) forwards SIGTERM to the workers (the runtime runs the
  flow without a dead rank) and waits the same way;
* kills whatever is still running when the wait ends, then lets torch report the failure, so the
  launcher exits non-zero and a scheduler restarts the job.

``--max-restarts`` keeps torchrun's meaning and default (0): after the grace period, when restarts
remain, the worker group is restarted in place (the workers resume from the dying checkpoint);
otherwise the launcher exits. A fresh ``TTP_RUN_DIR`` is made per launch; before a restart the
previous attempt's ``flow-finished.json`` is moved aside so it cannot end the next wait early.
Control-plane key: on a single node, when neither ``TTP_AUTH_KEY`` nor ``TTP_AUTH_KEY_FILE`` is
set, the launcher generates one and hands it to its own workers in their environment. Across
nodes the key must come from the user or the scheduler: nothing secret ever goes through torch's
rendezvous store, which has no authentication and listens on every interface, so a multi-node
start without a key is refused with a message that says how to provide one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from mindio_ttp import config
from mindio_ttp.config import (
    ENV_AGENT_SOCKET,
    ENV_AUTH_KEY,
    ENV_AUTH_KEY_FILE,
    ENV_LOG_LEVEL,
    ENV_NODE_AGENT,
    ENV_OT,
    ENV_REPLACEMENTS,
    ENV_RUN_DIR,
    ENV_WARM_SPARES,
    FLOW_FINISHED_FILE,
    JOB_COMPLETE_FILE,
    RECOVERY_MODE_FILE,
    RUNTIME_STARTED_DIR,
    auth_key_from_env,
    warm_spares,
)
from mindio_ttp.control.agent.node import NodeAgent
from mindio_ttp.control.agent.process import settings_from_env
from mindio_ttp.control.wire.keys import hop_key
from mindio_ttp.drill import DrillSpec
from mindio_ttp.faulttime import collective_env
from mindio_ttp.launch import drill, gloo_iface, preflight, takeover, torch_private
from mindio_ttp.launch.outcome import (
    CheckpointArgs,
    Ending,
    closing_lines,
    describe_flow,
    read_flow,
    read_recovered,
    record,
    write_outcome_file,
)
from mindio_ttp.launch.procstate import read_proc_state, signal_worker
from mindio_ttp.launch.replace import ReplacementDesk, cold_start
from mindio_ttp.launch.siblings import Siblings
from mindio_ttp.launch.spares import pool_from_spec

logger = logging.getLogger("ttprun")

DEFAULT_OT_S = config.BY_NAME[ENV_OT].value

# Once the flow has finished, the runtime makes every worker exit on its own; a worker that has not
# exited this many seconds later is killed (it may be wedged in a collective with a dead peer).
POST_FLOW_EXIT_S = 15.0
POLL_S = 0.05
RDZV_WAIT_NOTICE_S = config.BY_NAME[config.ENV_RDZV_NOTICE].value  # main() reads the env
# How long the monitor loop waits for one answer of the rendezvous store before it goes on
# watching the workers (the answer is used when it comes; a healthy store answers in ms).
RDZV_QUERY_WAIT_S = 1.0


def _key_or_none() -> Optional[bytes]:
    try:
        return auth_key_from_env(os.environ)
    except ValueError:
        return None


def is_multi_node(nnodes: str) -> bool:
    """torchrun's --nnodes is N or MIN:MAX; more than one node may join unless MAX is 1."""
    return str(nnodes).split(":")[-1].strip() != "1"


overtime_s = config.overtime_s  # TTP_OT: how long survivors may run after a fault


def _is_stopped(pid: int) -> bool:
    """True for a process in the stopped/traced state: it will not exit by itself."""
    return read_proc_state(pid) in ("T", "t")


@contextlib.contextmanager
def _close_deferred(pcontext: SubprocessContext) -> Iterator[None]:
    """Make ``pcontext.close`` a no-op while torch polls, so a failure does not kill siblings."""
    pcontext.close = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pcontext.close


def _read_marker(path: Path) -> str:
    """The job-complete marker's text (main's merge of h/user dropped this helper but kept a
    call to it)."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:  # the file is written atomically, but report rather than crash
        return f"(unreadable: {exc})"


class TTPElasticAgent(LocalElasticAgent):
    """LocalElasticAgent that holds survivors for the dying checkpoint instead of killing them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ot_s = overtime_s()
        self._run_dir = Path(os.environ[ENV_RUN_DIR])
        self._attempt = 0
        self._attempt_store = None  # the TCPStore this node hosts for the current attempt
        self._store_lost = False
        spec = self._worker_group.spec
        self._spares = pool_from_spec(warm_spares(), spec.entrypoint, spec.args)
        self._takeover: Optional[takeover.NodeTakeover] = None
        if spec.rdzv_handler.get_backend() != "static":
            takeover.republish_bootstrap(spec.rdzv_handler)
        if takeover.wanted(spec.rdzv_handler, os.environ) and takeover.available():
            self._takeover = takeover.NodeTakeover(
                spec.rdzv_handler, lambda requests: takeover.member_of(
                    self._worker_group, spec.max_restarts - self._remaining_restarts,
                    requests),
                auth_key_from_env(os.environ))
            os.environ[ENV_REPLACEMENTS] = "cold,node"  # the recovery may ask for a lost node
        self._spare_waiting_said = False
        self._node_agent: Optional[NodeAgent] = None  # this node's, per attempt
        self._mode_said = ""
        # other ttprun of this job on this host (launch/siblings.py)
        self._siblings = Siblings.open(_key_or_none(), self._run_dir)
        # in-memory recovery (replace.py): a warm spare when one is left, else a cold start;
        # a lost node's ranks go to the takeover, a sibling's ranks to that sibling
        self._replacements = ReplacementDesk(
            self._run_dir, (self._spares.start, cold_start),
            foreign=self._takeover.hold if self._takeover else None,
            sibling=self._siblings.owner if self._siblings else None)
        self._guard_rendezvous()

    # -- the rendezvous ---------------------------------------------------------------------
    def _guard_rendezvous(self) -> None:
        """Losing the rendezvous store must not stop this node's workers, nor freeze the agent.

        The store lives on one node (c10d: the first agent at the endpoint; static: node 0).
        When that node is lost, torch's monitor loop asks the store for waiting nodes, gets a
        RendezvousConnectionError and shuts this node's workers down (SIGTERM, SIGKILL 30 s
        later): the survivors die before their dying checkpoint. Here the loss is logged and
        the workers get the same grace as after a worker failure (TTP_OT), then the run ends.
        When the store's node is silent instead (partition, power loss: no RST), each store call
        blocks for torch's read_timeout (60 s): the query runs off the monitor loop, so the
        agent keeps watching its workers, and the rendezvous is not closed on the way out (its
        close would block the same way, once per store call).
        """
        handler = self._worker_group.spec.rdzv_handler
        query = _OffLoopQuery(handler.num_nodes_waiting, RDZV_QUERY_WAIT_S)
        shutdown = handler.shutdown

        def num_nodes_waiting() -> int:
            if self._store_lost:
                return 0
            waiting = query()
            if query.error is None:
                return waiting
            exc = query.error
            self._store_lost = True
            logger.warning(
                "ttprun: lost the rendezvous store (%s: %s): the node that hosts it is gone "
                "or unreachable; keeping this node's workers up to %.0f s (TTP_OT) for the "
                "dying checkpoint",
                type(exc).__name__, exc, self._ot_s,
            )
            pcontext = self._pcontext
            if isinstance(pcontext, SubprocessContext):
                self._hold_survivors(pcontext)
            return 0

        def shutdown_unless_unreachable() -> bool:
            if self._store_lost or query.in_flight:
                logger.warning(
                    "ttprun: not closing the rendezvous: its store %s; this node leaves "
                    "without it", "is gone" if self._store_lost else "does not answer",
                )
                return False
            return shutdown()

        handler.num_nodes_waiting = num_nodes_waiting
        handler.shutdown = shutdown_unless_unreachable

    # -- worker lifecycle -------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Give every restarted attempt a store of its own.

        torch's static rendezvous keeps one TCPStore for the whole run, and c10d's shared one
        lives as long as the agent of the round's rank 0 (torch assumes a new store per retry);
        workers use it without a per-attempt prefix, so a restarted attempt reads the previous
        attempt's keys (Gloo's peer addresses: "connectFullMesh failed ... Connection
        refused"; NCCL's unique id). Group rank 0's agent hosts a fresh store per restart on a
        free port and publishes the port in the rendezvous store under the attempt's own key;
        every node's workers get it as MASTER_PORT.
        """
        spec = worker_group.spec
        self._spares.replenish()  # warm while this node waits for the others
        with _say_what_we_wait_for(spec, may_be_spare=self._attempt == 0):
            super()._rendezvous(worker_group)
        taking = self._takeover.assignment if self._takeover else None
        if taking is not None:  # a lost node's place, not the round's numbering
            worker_group.group_rank = taking.group_rank
            worker_group.group_world_size = taking.group_world_size
            worker_group.master_addr, worker_group.master_port = (taking.master_addr,
                                                                   taking.master_port)
            self._remaining_restarts = spec.max_restarts - taking.restart_count
            return
        if self._takeover is not None and self._takeover.restart_count > (
                spec.max_restarts - self._remaining_restarts):
            logger.warning("ttprun: joining a job at restart %d", self._takeover.restart_count)
            self._remaining_restarts = spec.max_restarts - self._takeover.restart_count
        restart = spec.max_restarts - self._remaining_restarts
        if restart == 0:
            return  # the first attempt uses torch's store
        if not _workers_use_agent_store(spec.rdzv_handler):
            return  # their rank 0 hosts their store, on the port torch's rank 0 just chose
        # torch 2.2 on hands the workers the worker group's master_addr/port; torch 2.1's group
        # has neither: its _start_workers reads the round store's MASTER_ADDR/MASTER_PORT keys
        on_group = hasattr(worker_group, "master_addr")
        master_addr = (worker_group.master_addr if on_group
                       else self._get_master_addr_port(worker_group.store)[0])
        key = f"ttprun/attempt{restart}/store_port"
        if worker_group.group_rank == 0:
            self._attempt_store = None  # closes the previous attempt's: its port may be reused
            fresh = _restart_store(master_addr,
                                   config.value(os.environ, config.ENV_RESTART_STORE_PORTS))
            if not on_group:  # before the key: every node reads it once it sees the key
                worker_group.store.set("MASTER_PORT", str(fresh.port))
            worker_group.store.set(key, str(fresh.port))
            self._attempt_store = fresh  # the previous attempt's store closes with its object
        port = int(worker_group.store.get(key).decode())
        logger.info("ttprun: restart %d uses its own store %s:%d", restart, master_addr, port)
        if on_group:
            worker_group.master_port = port

    def _assign_worker_ranks(self, store, group_rank: int, group_world_size: int, spec):
        taking = self._takeover.assignment if self._takeover else None
        if taking is not None:
            return takeover.workers_for(taking)
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """A node waits while this node's workers are healthy: a spare node. It takes over a
        lost node's ranks when the recovery asked for them (mindio_ttp.launch.takeover);
        otherwise it stays a spare and nothing restarts."""
        if self._takeover is None or worker_group.state != WorkerState.HEALTHY:
            return super()._restart_workers(worker_group)
        if not self._takeover.should_join(self._store):
            if not self._spare_waiting_said:
                self._spare_waiting_said = True
                logger.warning("ttprun: a node waits in the rendezvous and no takeover is "
                               "wanted: it stays a spare; this node's workers keep running")
            return None
        try:
            info = self._takeover.join_with_running_workers()
        except Exception as exc:  # noqa: BLE001 - RendezvousError, DistStoreError, refusal
            logger.error("ttprun: the takeover round failed (%s: %s); this node's workers keep "
                         "running (their recovery falls back to the dying checkpoint)",
                         type(exc).__name__, exc)
            return None
        self._store = worker_group.store = info.store  # the round this node now belongs to
        for request, detail in self._takeover.handed_over_requests():
            self._replacements.answer(request, "started", detail)
        self._spare_waiting_said = False
        return None

    def _start_workers(self, worker_group: WorkerGroup):  # noqa: D401 - torch's signature
        marker = self._run_dir / FLOW_FINISHED_FILE
        if marker.exists():
            marker.rename(self._run_dir / f"flow-finished.attempt{self._attempt}.json")
        with contextlib.suppress(FileNotFoundError):  # a restarted attempt completes anew
            (self._run_dir / JOB_COMPLETE_FILE).unlink()
        shutil.rmtree(self._run_dir / RUNTIME_STARTED_DIR, ignore_errors=True)  # per attempt
        self._replacements = self._replacements.fresh()  # a new attempt counts recoveries anew
        self._attempt += 1
        self._start_node_agent(worker_group)
        if self._siblings is not None:
            self._siblings.publish([w.global_rank for w in worker_group.workers])
        if self._takeover is None or self._takeover.assignment is None:
            return super()._start_workers(worker_group)
        with takeover.replacement_workers(self._takeover.assignment, self._spares):
            return super()._start_workers(worker_group)

    def _start_node_agent(self, worker_group: WorkerGroup) -> None:
        """This process is its node's agent (docs/design.md, the tiers): a fresh one per
        attempt (a restarted attempt has a new controller), on a socket in the private run
        directory that the workers are told of (TTP_AGENT_SOCKET). It holds the hop key only."""
        self._stop_node_agent()
        os.environ.pop(ENV_AGENT_SOCKET, None)
        if not config.value(os.environ, ENV_NODE_AGENT) or not worker_group.workers:
            return
        _agent_log_at(config.value(os.environ, ENV_LOG_LEVEL))
        try:
            world = worker_group.workers[0].world_size
            settings = settings_from_env(world)
            settings.local_world = len(worker_group.workers)
            agent = NodeAgent(hop_key(auth_key_from_env(os.environ)), settings,
                              str(self._run_dir / f"agent-{self._attempt}.sock"),
                              name=f"node agent (ttprun, node {worker_group.group_rank})")
            os.environ[ENV_AGENT_SOCKET] = agent.start()
            self._node_agent = agent
        except (OSError, ValueError) as exc:  # the workers then start their own, or go direct
            logger.warning("ttprun: no node agent in this launcher (%s)", exc)

    def _stop_node_agent(self) -> None:
        if self._node_agent is not None:
            self._node_agent.stop()
            self._node_agent = None

    def _runtime_started(self) -> bool:
        started = self._run_dir / RUNTIME_STARTED_DIR
        return started.is_dir() and any(started.iterdir())

    def _say_recovery_mode(self) -> None:
        """Print, once it appears, the recovery mode rank 0 found its process groups allow
        (framework_ttp writes it when the controller starts): the check at ttprun's start sees
        the machine's stack, this one the job's own groups."""
        try:
            said = (self._run_dir / RECOVERY_MODE_FILE).read_text().strip()
        except OSError:
            return
        if said and said != self._mode_said:
            self._mode_said = said
            print(f"ttprun: recovery mode (rank 0, on the job's process groups): {said}",
                  file=sys.stderr, flush=True)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._say_recovery_mode()
        if self._siblings is not None:
            self._siblings.notice()
        self._spares.replenish()
        pcontext = self._pcontext
        if not isinstance(pcontext, SubprocessContext):
            return super()._monitor_workers(worker_group)  # function entry points: stock policy
        self._serve_replacements(pcontext, worker_group)
        with _close_deferred(pcontext):
            result = super()._monitor_workers(worker_group)
        if result.state != WorkerState.FAILED:
            return result
        failed = sorted(result.failures)
        if (self._run_dir / JOB_COMPLETE_FILE).exists():
            return self._complete_despite(pcontext, worker_group, failed)
        if not self._runtime_started() and not (self._run_dir / FLOW_FINISHED_FILE).exists():
            logger.warning(
                "ttprun: worker rank(s) %s failed and no TTP runtime started in this attempt on "
                "this node: nothing to save, so the others are not held for TTP_OT",
                failed,
            )
            return result
        if (self._run_dir / FLOW_FINISHED_FILE).exists():
            logger.warning("ttprun: worker rank(s) %s exited; the flow has already finished",
                           failed)
        else:
            logger.warning(
                "ttprun: worker rank(s) %s failed; keeping survivors up to %.0f s (TTP_OT) for "
                "the dying checkpoint",
                failed,
                self._ot_s,
            )
        if self._hold_survivors(pcontext, worker_group):
            return RunResult(state=WorkerState.HEALTHY)  # every failed worker was replaced
        with _close_deferred(pcontext):
            final = super()._monitor_workers(worker_group)
        if final.state != WorkerState.FAILED:
            return result
        self._rank_consequences_last(final)
        return final

    def _complete_despite(self, pcontext: SubprocessContext, worker_group: WorkerGroup,
                          failed: List[int]) -> RunResult:
        """Workers failed after the job's final checkpoint was complete on every rank (a
        worker wrote $TTP_RUN_DIR/job-complete.json past the barrier that ends it): nothing is
        lost and a restart would only load it to save it again, so the job succeeds. The other
        workers get POST_FLOW_EXIT_S to finish (a last evaluation; on NCCL its collective
        with the lost worker never returns), then are killed."""
        logger.warning("ttprun: worker rank(s) %s failed after the job's final checkpoint was "
                       "complete on every rank (%s): nothing is lost, the job succeeds", failed,
                       _job_complete(self._run_dir / JOB_COMPLETE_FILE))
        deadline = time.monotonic() + POST_FLOW_EXIT_S
        while time.monotonic() < deadline and any(
                h.proc.poll() is None for h in pcontext.subprocess_handlers.values()):
            time.sleep(POLL_S)
        for rank, handler in pcontext.subprocess_handlers.items():
            if handler.proc.poll() is None:
                logger.warning("ttprun: killing worker %s (pid %s): still running %.0f s after "
                               "the job completed", rank, handler.proc.pid, POST_FLOW_EXIT_S)
                signal_worker(handler.proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    handler.proc.wait(timeout=10)
        # torch's success names every worker (its return value: none for a command)
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in worker_group.workers})

    def _rank_consequences_last(self, result: RunResult) -> None:
        """Torch names the failure with the smallest timestamp (whole seconds) the root cause; a
        worker that exited with the flow's own exit code did so *because* of the fault, so push
        those behind the rank that actually failed."""
        flow, _ = read_flow(self._run_dir / FLOW_FINISHED_FILE)
        if flow is None:
            return
        consequence = flow.exit_code
        failures = list(result.failures.values())
        if not failures:
            return
        after = max(f.timestamp for f in failures) + 1
        for failure in failures:
            if failure.exitcode == consequence:
                failure.timestamp = after

    def _serve_replacements(self, pcontext: SubprocessContext, worker_group: WorkerGroup) -> None:
        """The recovery's requests: this node's ranks started here; a lost node's held for a
        spare node (failed at once when none waits)."""
        self._replacements.serve(pcontext, worker_group.workers)
        if self._takeover is not None:
            for request in self._takeover.announce(self._store):
                self._replacements.answer(request, "failed", "no spare node waits in the "
                                          "rendezvous to take over the lost node")

    def run(self, role: str = "default") -> RunResult:
        result = super().run(role)
        if result is None:  # torch: the rendezvous closed while this node waited (a spare)
            logger.warning("ttprun: the job ended while this node waited as a spare; exit 0")
            return RunResult(state=WorkerState.SUCCEEDED)
        return result

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
        # torch passes on what it has: 2.1 has no `timeout` (`_shutdown(death_sig)`), later
        # releases add it (`_shutdown(sig, timeout=...)`); handing on exactly what torch gave
        # serves both (launch/torch_private.py accepts both shapes)
        self._spares.close()
        if self._siblings is not None:
            self._siblings.close()
        super()._shutdown(death_sig, *args, **kwargs)
        self._stop_node_agent()

    def _invoke_run(self, role: str = "default") -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as exc:
            pcontext = self._pcontext
            if exc.sigval == signal.SIGTERM and isinstance(pcontext, SubprocessContext):
                logger.warning(
                    "ttprun: SIGTERM (preemption): forwarding it to the workers and waiting up to "
                    "%.0f s (TTP_OT) for the dying checkpoint",
                    self._ot_s,
                )
                for pid in pcontext.pids().values():
                    signal_worker(pid, signal.SIGTERM)
                self._hold_survivors(pcontext)
            raise
        finally:
            self._spares.close()
            self._stop_node_agent()
            if self._siblings is not None:
                self._siblings.close()

    # -- the grace period -------------------------------------------------------------------
    def _hold_survivors(self, pcontext: SubprocessContext,
                        worker_group: Optional[WorkerGroup] = None) -> bool:
        """Wait for the flow to finish and the workers to exit; kill whatever is left after.
        With `worker_group`, an in-memory recovery may replace the failed workers instead:
        True when every worker runs again (nothing was killed)."""
        start = time.monotonic()
        deadline = start + self._ot_s
        marker = self._run_dir / FLOW_FINISHED_FILE
        flow_done_at: Optional[float] = None
        reason = f"TTP_OT ({self._ot_s:.0f} s) ran out before the flow finished"
        try:
            while True:
                alive = {
                    rank: h.proc.pid
                    for rank, h in pcontext.subprocess_handlers.items()
                    if h.proc.poll() is None
                }
                now = time.monotonic()
                if flow_done_at is None and marker.exists():
                    flow_done_at = now
                    logger.warning("ttprun: dying-checkpoint flow finished after %.2f s: %s",
                                   now - start, describe_flow(*read_flow(marker)))
                if worker_group is not None and flow_done_at is None:
                    self._serve_replacements(pcontext, worker_group)
                    if all(h.proc.poll() is None for h in pcontext.subprocess_handlers.values()):
                        logger.warning("ttprun: in-memory recovery: every failed worker "
                                       "replaced after %.2f s", time.monotonic() - start)
                        return True
                if not alive:
                    logger.warning("ttprun: every worker exited after %.2f s", now - start)
                    return False
                if flow_done_at is not None:
                    for rank, pid in alive.items():
                        if _is_stopped(pid):
                            logger.warning("ttprun: killing stopped worker %s (pid %s)", rank, pid)
                            signal_worker(pid, signal.SIGKILL)
                    if now - flow_done_at > POST_FLOW_EXIT_S:
                        reason = f"still running {POST_FLOW_EXIT_S:.0f} s after the flow finished"
                        break
                if now >= deadline:
                    break
                time.sleep(POLL_S)
        except SignalException as exc:
            reason = f"second signal {exc.sigval.name} during the grace period"
        for rank, handler in pcontext.subprocess_handlers.items():
            if handler.proc.poll() is None:
                logger.warning(
                    "ttprun: killing worker %s (pid %s): %s", rank, handler.proc.pid, reason
                )
                signal_worker(handler.proc.pid, signal.SIGKILL)
        for handler in pcontext.subprocess_handlers.values():
            with contextlib.suppress(Exception):
                handler.proc.wait(timeout=10)
        return False


def _workers_use_agent_store(handler) -> bool:
    """Whether the workers' env:// store is the launcher's (TORCHELASTIC_USE_AGENT_STORE): a
    handler with `use_agent_store` says so (2.13's c10d shares its store unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1); torch 2.1 shares only the static rendezvous's."""
    shared = getattr(handler, "use_agent_store", None)
    return bool(shared) if shared is not None else handler.get_backend() == "static"


def _restart_store(host: str, ports: Optional[Tuple[int, int]]):
    """A restarted attempt's store: on an ephemeral port, or on the first free port of
    TTP_RESTART_STORE_PORTS (a firewall that opens only known ports); none free: say which."""
    from torch.distributed import TCPStore

    candidates = [0] if ports is None else list(range(ports[0], ports[1] + 1))
    errors = []
    for port in candidates:
        try:
            # never multi-tenant on a fixed port: it would share a store left in this process
            return TCPStore(host_name=host, port=port, is_master=True, wait_for_workers=False,
                            multi_tenant=port == 0)
        except (RuntimeError, OSError) as exc:  # DistNetworkError: the port is taken
            errors.append(f"{port}: {exc}".splitlines()[0][:120])
    raise RuntimeError(f"ttprun: no port of {config.ENV_RESTART_STORE_PORTS}="
                       f"{ports[0]}-{ports[1]} is free for the restarted attempt's store "
                       f"({'; '.join(errors[:3])}): widen the range")


def _job_complete(path: Path) -> str:
    """What job-complete.json says, in words (it is written atomically; never raises)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return f"iteration {record['step']}, {record.get('checkpoint') or 'no checkpoint named'}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path.name} unreadable: {exc}"


class _OffLoopQuery:
    """A store query run in a thread of its own, at most one at a time.

    The caller waits up to ``wait_s`` for the answer; while a query is still out it gets 0
    ("no node waiting": torch then changes nothing) and the query goes on in the background.
    ``error`` is what the last finished query raised, if it raised."""

    def __init__(self, call: Callable[[], int], wait_s: float) -> None:
        self._call = call
        self._wait_s = wait_s
        self._thread: Optional[threading.Thread] = None
        self._answer = 0
        self.error: Optional[BaseException] = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __call__(self) -> int:
        if self.in_flight or self.error is not None:
            return 0
        self._answer = 0
        self._thread = threading.Thread(target=self._run, name="ttprun-rdzv-query",
                                        daemon=True)
        self._thread.start()
        self._thread.join(self._wait_s)
        return 0 if self.in_flight else self._answer

    def _run(self) -> None:
        try:
            self._answer = self._call()
        except Exception as exc:  # noqa: BLE001 - RendezvousConnectionError, DistNetworkError, ...
            self.error = exc


@contextlib.contextmanager
def _say_what_we_wait_for(spec, may_be_spare: bool = False) -> Iterator[None]:
    """While the rendezvous blocks (torch waits up to 600 s for absent nodes, silently), say
    every RDZV_WAIT_NOTICE_S what it waits for, where, and how to bound the wait."""
    done = threading.Event()
    handler = spec.rdzv_handler
    backend = handler.get_backend()
    where = getattr(handler, "master_addr", None)
    where = f"{where}:{handler.master_port}" if where else "the --rdzv-endpoint"
    bound = ("--rdzv-conf join_timeout=SECONDS" if backend != "static"
             else "--rdzv-conf timeout=SECONDS")

    def notice() -> None:
        waited = 0.0
        while not done.wait(RDZV_WAIT_NOTICE_S):
            waited += RDZV_WAIT_NOTICE_S
            if may_be_spare and takeover.is_spare(handler):
                logger.warning("ttprun: this node is a spare: the rendezvous of run %r is full; "
                               "it waits, with no deadline, to take over a lost node",
                               handler.get_run_id())
                done.wait()
                return
            logger.warning(
                "ttprun: waited %.0f s for the other nodes of run %r (%s rendezvous at %s): "
                "start ttprun on every node with the same --nnodes, --rdzv-id and endpoint; "
                "bound the wait with %s",
                waited, handler.get_run_id(), backend, where, bound,
            )

    thread = threading.Thread(target=notice, name="ttprun-rdzv-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


@contextlib.contextmanager
def ttp_environment(extra: Optional[dict] = None) -> Iterator[Path]:
    """Export a fresh TTP_RUN_DIR and, unless the user gave a key, a generated TTP_AUTH_KEY to
    this node's workers (environment only: never the rendezvous store), and `extra`.

    When ``TTP_RUN_DIR`` is already set it is taken as the parent of the per-launch directory,
    which is then kept (so a caller can read ``flow-finished.json``); otherwise a temporary one is
    made and removed at exit.
    """
    extra = extra or {}
    saved = {name: os.environ.get(name)
             for name in (ENV_RUN_DIR, ENV_AUTH_KEY, ENV_REPLACEMENTS, ENV_AGENT_SOCKET,
                          *collective_env.NAMES, *extra)}
    parent = saved[ENV_RUN_DIR]
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"ttprun-{os.getpid()}-", dir=parent or None))
    os.environ[ENV_RUN_DIR] = str(run_dir)
    if not saved[ENV_AUTH_KEY] and not os.environ.get(ENV_AUTH_KEY_FILE):
        os.environ[ENV_AUTH_KEY] = secrets.token_hex(32)  # single node (preflight.check)
    collective_env.apply_defaults(os.environ)
    os.environ.update(extra)
    os.environ[ENV_REPLACEMENTS] = "cold"  # this launcher starts a lost rank's replacement
    try:
        yield run_dir
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not parent:
            shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def _agent_installed() -> Iterator[None]:
    """Have torch's own ``launch_agent`` build our agent (it names LocalElasticAgent globally)."""
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = TTPElasticAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


def build_parser():
    """torch's torchrun parser, renamed; ``ttprun --help`` lists exactly torchrun's options."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ttprun"
    parser.description = textwrap.fill(
        "torchrun for fault-tolerant training: when a worker is lost it starts the replacement "
        "an in-memory recovery asks for (TTP_RECOVERY=in-memory, the default), and whenever "
        "the job must stop instead (TTP_RECOVERY=dying-checkpoint, a recovery that cannot work, "
        "SIGTERM) the survivors get up to TTP_OT seconds (default 120) to write the dying "
        "checkpoint. Same arguments as torchrun, plus --check (pre-flight), --drill (a fault "
        "on purpose) and --outcome-file: docs/first-day.md.", 96
    )
    from mindio_ttp import __version__

    parser.add_argument("--version", action="version", version=f"ttprun {__version__}")
    parser.add_argument(
        "--check", action="store_true",
        help="pre-flight check instead of the launch: run it on every node with the arguments "
        "of the real launch; the nodes meet through its rendezvous, try the controller port, "
        "the standby listeners and the gloo/NCCL/HCCL interface of each other, compare clocks "
        "and settings, write into --save; one table, exit 0 or 1 (nothing is started)")
    parser.add_argument(
        "--drill", type=_drill_spec, default=None, metavar="KIND[:rank=R|random]:iter=N",
        help="fire drill: provoke one real fault in this job on purpose, KIND kill (SIGKILL), "
        "hang (SIGSTOP) or exception, on rank R (default random, the same on every node) right "
        "after the update of iteration N; afterwards ttprun says whether the job recovered in "
        "memory or wrote the dying checkpoint, and whether the result checks out. Off unless "
        "given; give the same --drill on every node")
    parser.add_argument(
        "--outcome-file", metavar="PATH", default=None,
        help="write how the launch ended as JSON to PATH (atomically, on every ending: "
        "outcome, exit code, iteration, checkpoint, whether it is latest and whether this "
        "command resumes from it; docs/troubleshooting.md), so a wrapper need not parse logs")
    parser.add_argument(
        "--warm-spares", type=int, default=None, metavar="N",
        help=f"keep N warm spares per node: processes that have imported torch and the training "
        f"script's imports and wait to replace a lost rank (default ${ENV_WARM_SPARES} or 0)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = preflight.help_epilog()
    return parser


def _drill_spec(text: str) -> DrillSpec:
    try:
        return DrillSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _agent_log_at(level: str) -> None:
    """The node agent in this process says what it does at TTP_LOG_LEVEL, in ttprun's plain
    format (without a handler only its warnings reached stderr: which standbys it would fail
    over to, and whom it registered with, were never said)."""
    agent_log = logging.getLogger("mindio_ttp.agent")
    if not any(getattr(h, "_ttprun", False) for h in agent_log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._ttprun = True  # type: ignore[attr-defined]
        agent_log.addHandler(handler)
        agent_log.propagate = False
    agent_log.setLevel(level)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ttprun``; returns the exit code (1 when a worker failed)."""
    from torch.distributed.run import run

    global RDZV_WAIT_NOTICE_S
    drift = torch_private.problems()
    if drift:  # before torch's own parser: that may be what drifted
        print(f"ttprun: error: {torch_refusal(drift)}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.warm_spares is not None:
        os.environ[ENV_WARM_SPARES] = str(args.warm_spares)
    problems, warnings = preflight.check(os.environ, is_multi_node(args.nnodes),
                                         args.training_script_args, args.training_script,
                                         is_module=args.module)
    for warning in warnings:
        print(f"ttprun: warning: {warning}", file=sys.stderr)
    if problems:
        print(f"ttprun: error: {preflight.refusal(problems)}", file=sys.stderr)
        return 2
    RDZV_WAIT_NOTICE_S = config.value(os.environ, config.ENV_RDZV_NOTICE)
    ifname, note = gloo_iface.choose(os.environ, gloo_iface.rendezvous_host(args),
                                     is_multi_node(args.nnodes))
    if note:
        print(f"ttprun: {note}", file=sys.stderr)
    extra = {gloo_iface.NAME: ifname} if ifname else {}
    said, forced = preflight.recovery_mode(os.environ)
    print(f"ttprun: {said}", file=sys.stderr)
    if forced:
        extra[config.ENV_RECOVERY] = forced
    if args.check:
        from mindio_ttp.launch.check import run_check

        return run_check(args, {**os.environ, **extra})
    dropped = drill.drop_inherited(os.environ)
    if dropped:
        print(f"ttprun: warning: {dropped}", file=sys.stderr)
    ckpt = CheckpointArgs.parse(args.training_script_args)
    with ttp_environment(extra) as run_dir, _agent_installed():
        logger.info("ttprun: TTP_RUN_DIR=%s", run_dir)
        if args.drill is not None:
            os.environ[drill.ENV] = args.drill.to_env(str(run_dir))
            for line in drill.announce(args.drill, drill.fixed_world(args.nnodes,
                                                                     args.nproc_per_node),
                                       dict(os.environ)):
                print(f"ttprun: {line}", file=sys.stderr, flush=True)
        try:
            run(args)
        except ChildFailedError as exc:
            flow, unreadable = read_flow(run_dir / FLOW_FINISHED_FILE)
            if flow is None:
                print(str(exc), file=sys.stderr)
            ending = Ending(1, exc.failures, flow, unreadable)
        except SignalException as exc:
            flow, unreadable = read_flow(run_dir / FLOW_FINISHED_FILE)
            ending = Ending(128 + int(exc.sigval), {}, flow, unreadable,
                            signal=signal.Signals(exc.sigval).name)
        else:
            ending = Ending(0)
        ending.recoveries = read_recovered(run_dir)
        found = drill.verdict(args.drill, run_dir, ending) if args.drill else None
        os.environ.pop(drill.ENV, None)
        return _close(ending, ckpt, args.outcome_file, found)


def torch_refusal(drift: Sequence[str]) -> str:
    """What ttprun says (after "ttprun: error: ") before it exits 2 on a torch whose private
    names it overrides or reads have drifted (launch/torch_private.py)."""
    import torch

    lines = "\n".join(f"  - {line}" for line in drift)
    return (f"torch {torch.__version__} is not what ttprun is built on: ttprun is torch's "
            f"launcher with one class replaced, and this torch differs where it matters:\n"
            f"{lines}\nnothing was started; ttprun supports torch >= 2.1 (README, supported "
            "stacks); `python -m mindio_ttp.launch.torch_private` repeats this check")


def _close(ending: Ending, ckpt: CheckpointArgs, outcome_file: Optional[str],
           found: Optional[Tuple[List[str], dict]] = None) -> int:
    """Say how the launch ended (the same lines for every ending, then the drill's verdict),
    write --outcome-file."""
    lines = closing_lines(ending, ckpt) + (found[0] if found else [])
    for line in lines:
        print(f"ttprun: {line}", file=sys.stderr)
    if outcome_file:
        error = write_outcome_file(outcome_file, record(ending, ckpt, lines,
                                                        found[1] if found else None))
        if error:
            print(f"ttprun: warning: {error}", file=sys.stderr)
    return ending.exit_code


if __name__ == "__main__":
    sys.exit(main())
