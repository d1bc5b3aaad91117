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

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.utils.process_state import read_proc_state

from mindio_ttp.framework_ttp.config import (
    DEFAULTS,
    ENV_AUTH_KEY,
    ENV_AUTH_KEY_FILE,
    ENV_OT,
    ENV_RUN_DIR,
    FLOW_FINISHED_FILE,
    read_key_file,
)

logger = logging.getLogger("ttprun")

DEFAULT_OT_S = DEFAULTS[ENV_OT]

# Once the flow has finished, the runtime makes every worker exit on its own; a worker that has not
# exited this many seconds later is killed (it may be wedged in a collective with a dead peer).
POST_FLOW_EXIT_S = 15.0
POLL_S = 0.05
MULTI_NODE_KEY_MESSAGE = (
    "a multi-node job needs a control-plane key that every node already has: export "
    f"{ENV_AUTH_KEY}=<64 hex chars> on every node (e.g. generate it once with `python -c "
    "'import secrets; print(secrets.token_hex(32))'` and pass it through your scheduler's "
    f"secret store), or point {ENV_AUTH_KEY_FILE} at a chmod-600 file on every node. ttprun "
    "does not send keys over the network."
)


def is_multi_node(nnodes: str) -> bool:
    """torchrun's --nnodes is N or MIN:MAX; more than one node may join unless MAX is 1."""
    return str(nnodes).split(":")[-1].strip() != "1"


def overtime_s(environ: Optional[dict] = None) -> float:
    """``TTP_OT`` in seconds: how long survivors may run after a fault (default 120)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_OT, "")
    if not raw.strip():
        return DEFAULT_OT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_OT}={raw!r} is not a number of seconds; set e.g. {ENV_OT}=120"
        ) from None
    if value < 0:
        raise ValueError(f"{ENV_OT}={raw!r} is negative; set a number of seconds >= 0")
    return value


def _is_stopped(pid: int) -> bool:
    """True for a process in the stopped/traced state: it will not exit by itself."""
    return read_proc_state(pid) in ("T", "t")


def _signal_group(pid: int, sig: int) -> None:
    """Signal the worker's process group (torch starts each worker in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@contextlib.contextmanager
def _close_deferred(pcontext: SubprocessContext) -> Iterator[None]:
    """Make ``pcontext.close`` a no-op while torch polls, so a failure does not kill siblings."""
    pcontext.close = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pcontext.close


class TTPElasticAgent(LocalElasticAgent):
    """LocalElasticAgent that holds survivors for the dying checkpoint instead of killing them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ot_s = overtime_s()
        self._run_dir = Path(os.environ[ENV_RUN_DIR])
        self._attempt = 0

    # -- worker lifecycle -------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup):  # noqa: D401 - torch's signature
        marker = self._run_dir / FLOW_FINISHED_FILE
        if marker.exists():
            marker.rename(self._run_dir / f"flow-finished.attempt{self._attempt}.json")
        self._attempt += 1
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pcontext = self._pcontext
        if not isinstance(pcontext, SubprocessContext):
            return super()._monitor_workers(worker_group)  # function entry points: stock policy
        with _close_deferred(pcontext):
            result = super()._monitor_workers(worker_group)
        if result.state != WorkerState.FAILED:
            return result
        failed = sorted(result.failures)
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
        self._hold_survivors(pcontext)
        with _close_deferred(pcontext):
            final = super()._monitor_workers(worker_group)
        if final.state != WorkerState.FAILED:
            return result
        self._rank_consequences_last(final)
        return final

    def _rank_consequences_last(self, result: RunResult) -> None:
        """Torch names the failure with the smallest timestamp (whole seconds) the root cause; a
        worker that exited with the flow's own exit code did so *because* of the fault, so push
        those behind the rank that actually failed."""
        try:
            flow = json.loads((self._run_dir / FLOW_FINISHED_FILE).read_text(encoding="utf-8"))
            consequence = int(flow["exit_code"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        failures = list(result.failures.values())
        if not failures:
            return
        after = max(f.timestamp for f in failures) + 1
        for failure in failures:
            if failure.exitcode == consequence:
                failure.timestamp = after

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
                    _signal_group(pid, signal.SIGTERM)
                self._hold_survivors(pcontext)
            raise

    # -- the grace period -------------------------------------------------------------------
    def _hold_survivors(self, pcontext: SubprocessContext) -> None:
        """Wait for the flow to finish and the workers to exit; kill whatever is left after."""
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
                    logger.warning(
                        "ttprun: dying-checkpoint flow finished after %.2f s: %s",
                        now - start,
                        _read_marker(marker),
                    )
                if not alive:
                    logger.warning("ttprun: every worker exited after %.2f s", now - start)
                    return
                if flow_done_at is not None:
                    for rank, pid in alive.items():
                        if _is_stopped(pid):
                            logger.warning("ttprun: killing stopped worker %s (pid %s)", rank, pid)
                            _signal_group(pid, signal.SIGKILL)
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
                _signal_group(handler.proc.pid, signal.SIGKILL)
        for handler in pcontext.subprocess_handlers.values():
            with contextlib.suppress(Exception):
                handler.proc.wait(timeout=10)


def _read_marker(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:  # the file is written atomically, but report rather than crash
        return f"(unreadable: {exc})"


def check_key_source(multi_node: bool) -> None:
    """Refuse, before anything starts, a key file that is unsafe or unreadable, and a multi-node
    launch with no key at all (ValueError with what to do)."""
    if os.environ.get(ENV_AUTH_KEY):
        return
    if os.environ.get(ENV_AUTH_KEY_FILE):
        read_key_file(os.environ[ENV_AUTH_KEY_FILE])
    elif multi_node:
        raise ValueError(MULTI_NODE_KEY_MESSAGE)


_OUTCOME_WORDS = {
    "saved": "dying checkpoint of iteration {step} saved and marked latest",
    "no_consistent_step": "no step had a clean copy of every shard, so nothing was saved "
    "(the last regular checkpoint stays latest)",
    "save_failed": "the dying-checkpoint save failed ({reason}); nothing new was marked latest",
    "no_verdict": "no save decision was reached ({reason}); nothing new was marked latest",
    "not_claimed": "this part of the job saved nothing ({reason}); at most one part of a split "
    "job saves a fault's checkpoint",
}


def _read_flow(path: Path) -> Optional[dict]:
    try:
        flow = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return flow if isinstance(flow, dict) else None


def outcome_lines(flow: Optional[dict], failures: dict) -> list:
    """The last lines of a failed run, in words: which rank failed, what the flow did, what next.

    Ranks that exited with the flow's own exit code did so *because* of the fault (e.g. 83 after
    saving), so they are not named as failures.
    """
    consequence = None if flow is None else flow.get("exit_code")
    failed = {r: f for r, f in failures.items() if f.exitcode != consequence}
    parts = []
    for rank, failure in sorted(failed.items()):
        when = time.strftime("%H:%M:%S", time.localtime(failure.timestamp))
        how = (f"was killed by {signal.Signals(-failure.exitcode).name}"
               if failure.exitcode < 0 else f"exited with code {failure.exitcode}")
        parts.append(f"rank {rank} (node {socket.gethostname()}) {how} at {when}")
    lines = ["; ".join(parts) or "the job was stopped"]
    if flow is None:
        lines.append("no dying-checkpoint flow ran; exit 1")
        return lines
    words = _OUTCOME_WORDS.get(str(flow.get("outcome")), "flow outcome {outcome}: {reason}")
    lines.append(words.format(step=flow.get("step"), reason=flow.get("reason"),
                              outcome=flow.get("outcome")) + f" (exit {consequence} on the "
                 "ranks that took part, not failures)")
    if flow.get("outcome") == "saved":
        lines.append("exit 1 so your scheduler restarts the job; run the same command to resume")
    else:
        lines.append("exit 1; rerunning the same command resumes from the last checkpoint")
    return lines


@contextlib.contextmanager
def ttp_environment() -> Iterator[Path]:
    """Export a fresh TTP_RUN_DIR and, unless the user gave a key, a generated TTP_AUTH_KEY to
    this node's workers (environment only: never the rendezvous store).

    When ``TTP_RUN_DIR`` is already set it is taken as the parent of the per-launch directory,
    which is then kept (so a caller can read ``flow-finished.json``); otherwise a temporary one is
    made and removed at exit.
    """
    saved = {name: os.environ.get(name) for name in (ENV_RUN_DIR, ENV_AUTH_KEY)}
    parent = saved[ENV_RUN_DIR]
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"ttprun-{os.getpid()}-", dir=parent or None))
    os.environ[ENV_RUN_DIR] = str(run_dir)
    if not saved[ENV_AUTH_KEY] and not os.environ.get(ENV_AUTH_KEY_FILE):
        os.environ[ENV_AUTH_KEY] = secrets.token_hex(32)  # single node (check_key_source)
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
    parser.description = (
        "torchrun with a dying-checkpoint grace period: when a worker fails or the launcher gets "
        "SIGTERM, surviving workers get up to TTP_OT seconds (default 120) to write the "
        "checkpoint before they are stopped. Same arguments as torchrun."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"ttprun {__version__}")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ttprun``; returns the exit code (1 when a worker failed)."""
    from torch.distributed.run import run

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        overtime_s()
    except ValueError as exc:
        print(f"ttprun: error: {exc}", file=sys.stderr)
        return 2
    try:
        check_key_source(is_multi_node(args.nnodes))
    except ValueError as exc:
        print(f"ttprun: error: {exc}", file=sys.stderr)
        return 2
    with ttp_environment() as run_dir, _agent_installed():
        logger.info("ttprun: TTP_RUN_DIR=%s", run_dir)
        try:
            run(args)
        except ChildFailedError as exc:
            flow = _read_flow(run_dir / FLOW_FINISHED_FILE)
            if flow is None:
                print(str(exc), file=sys.stderr)
            for line in outcome_lines(flow, exc.failures):
                print(f"ttprun: {line}", file=sys.stderr)
            return 1
        except SignalException as exc:
            return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
