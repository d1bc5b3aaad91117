"""Open replacement for MindIO TTP's `mindio_ttp.framework_ttp` (the RC2 `ttp_*` API).

Only the public functions the guide calls live here, each validating its arguments with a
ValueError that says what to pass; the work is in control/ (controller/server.py,
rank/processor.py) and hooks.py.
Handler contract: the save handler is `fn(step, save_ranks, ckpt_args)`, run in a
processor-owned thread on exactly the chosen ranks (concurrently); the rename handler is
`fn(step, ckpt_args)`, run on one rank after every save succeeded. Raise on failure. A rename
handler may also carry `checkpoint_location(step) -> str` (an attribute; the MindIO API has no
place for it): every rank's exit path calls it after a save, so flow-finished.json and ttprun's
last lines can name the directory.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import logging
import operator
import os
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from mindio_ttp import drill as _drill
from mindio_ttp import hooks as _hooks
from mindio_ttp.config import (
    CONTROLLER_PORT_RANGE,
    ENV_RECOVERY,
    ENV_RUN_DIR,
    JOB_COMPLETE_FILE,
    MAX_WORLD,
    RECOVERY_MODE_FILE,
    RECOVERY_MODES,
    RUNTIME_STARTED_DIR,
    ExitCode,
    Outcome,
    TTPConfig,
    _port_env,
)
from mindio_ttp.config import value as _config_value
from mindio_ttp.control.controller.host import ControllerProcess
from mindio_ttp.control.rank.processor import Processor
from mindio_ttp.faulttime import claim as _claim
from mindio_ttp.faulttime import device as _device
from mindio_ttp.faulttime import device_copy as _device_copy
from mindio_ttp.faulttime.save_session import SaveSession
from mindio_ttp.faulttime.save_session import current as _current_session
from mindio_ttp.handlers import HANDLERS
from mindio_ttp.hooks import TTPError, TTPForceStop
from mindio_ttp.launch.desk import LauncherDesk
from mindio_ttp.log import setup_logging
from mindio_ttp.recovery.rank import RECOVERY as _RECOVERY

__all__ = [
    "ttp_offer_update",
    "ttp_init_controller", "ttp_start_controller", "ttp_init_processor", "ttp_start_processor",
    "ttp_register_save_ckpt_handler", "ttp_register_rename_handler", "ttp_set_ckpt_args",
    "ttp_set_checkpoint_dir", "current_save_session",
    "ttp_start_updating_os", "ttp_end_updating_os", "ttp_to_persist", "ttp_shutdown",
    "ttp_job_complete", "TTPForceStop", "TTPError", "ExitCode", "Outcome",
]

log = logging.getLogger("mindio_ttp")

_lock = threading.Lock()
_controller_args: Optional[tuple] = None
_controller: Optional[ControllerProcess] = None
_processor_args: Optional[tuple] = None
_processor: Optional[Processor] = None


# -- validation helpers ---------------------------------------------------------------------------
def _int(name: str, value: Any, lo: int, hi: int, hint: str = "") -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}{hint}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}"
                         f"{hint}") from None
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} is out of range: pass {lo} <= {name} <= {hi}{hint}")
    return v


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    if value:
        raise ValueError(f"{name}=True (keep a local copy of the optimizer state) is not "
                         "supported by this runtime: pass False, as the guide does")
    return value


def _ip(ip: Any) -> str:
    if not isinstance(ip, str) or not ip.strip():
        raise ValueError(f"ip must be a non-empty string (the controller's address, e.g. "
                         f"os.getenv('MASTER_ADDR')), got {ip!r}")
    ip = ip.strip()
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip  # a host name: fine, resolution errors surface on connect with the name in them
    if addr.is_unspecified:
        raise ValueError(f"ip={ip!r} is the unspecified address: pass the address "
                         "processors can reach (MASTER_ADDR)")
    return ip


def _port(port: Any) -> int:
    override = _port_env(os.environ)
    if override is not None:
        return override
    return _int("port", port, *CONTROLLER_PORT_RANGE, " (or set TTP_CONTROLLER_PORT)")


def _handler(name: str, fn: Any, nargs: int, shape: str) -> Callable[..., Any]:
    if not callable(fn):
        raise ValueError(f"{name} needs a callable {shape}, got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*range(nargs))
    except TypeError:
        raise ValueError(f"{name}: {getattr(fn, '__name__', fn)!r} cannot be called as "
                         f"{shape}") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return fn


_setup_logging = setup_logging  # where it lived (tests and tools import it here)


# -- controller -----------------------------------------------------------------------------------
# Shards per DP group as the optimizer that holds them declared (ReplicatedOptimizer); None
# without one. The `replica` the training code passes must agree: one source for the layout.
_optimizer_shards: Optional[int] = None
_optimizer_order: Optional[List[int]] = None


def declare_optimizer_shards(shards: Optional[int],
                             dp_order: Optional[Sequence[int]] = None) -> None:
    """Called by the optimizer that keeps the replicated shards, when it is built (before
    train() initialises the runtime), so a `replica` argument that disagrees is refused.
    `dp_order`: this rank's DP group in the order whose place i holds shard i % replica, when
    the optimizer pairs its holders otherwise than Megatron's DP order (partners on different
    hosts: megatron_ttp/pairing.py); ttp_init_processor then reports that order."""
    global _optimizer_shards, _optimizer_order
    _optimizer_shards = None if shards is None else _int("shards", shards, 1, MAX_WORLD)
    _optimizer_order = None if dp_order is None else [int(r) for r in dp_order]


def _check_shards(where: str, replica: int) -> None:
    if _optimizer_shards is not None and replica != _optimizer_shards:
        raise ValueError(
            f"{where}: replica={replica} shards per DP group, but the optimizer keeps "
            f"{_optimizer_shards}: the controller would call a step consistent that no holder "
            f"has; pass the optimizer's shard count (ReplicatedOptimizer.num_shards)"
        )


def ttp_init_controller(rank: int, world_size: int, replica: int,
                        enable_local_copy: bool) -> None:
    """Prepare the controller on this rank (the guide: rank 0)."""
    global _controller_args
    world_size = _int("world_size", world_size, 1, MAX_WORLD)
    rank = _int("rank", rank, 0, world_size - 1)
    replica = _int("replica", replica, 1, world_size,
                   " (number of distinct optimizer shards per DP group: len(dp_ranks)//2; "
                   "a DP size of 1 has no replica to save from, use DP >= 2)")
    _check_shards("ttp_init_controller", replica)
    _bool("enable_local_copy", enable_local_copy)
    _controller_args = (rank, world_size, replica)


def ttp_start_controller(ip: str, port: int) -> None:
    """Start the controller, in a process of its own (control/controller/host.py: it must not share
    rank
    0's GIL with training), listening for processors on ip:port (TTP_CONTROLLER_PORT overrides
    port); returns once it listens."""
    global _controller
    ip, port = _ip(ip), _port(port)
    if _controller_args is None:
        raise TTPError("call ttp_init_controller(rank, world_size, replica, False) before "
                       "ttp_start_controller")
    if _rejoined():  # the acting controller already runs (here, or on a standby)
        log.info("ttp_start_controller after an in-memory recovery: the controller runs on")
        return
    with _lock:
        if _controller is not None:
            raise TTPError("ttp_start_controller was already called in this process")
        rank, world_size, replica = _controller_args
        _setup_logging(rank)
        ctl = ControllerProcess(TTPConfig.from_env(world_size=world_size), world_size, replica,
                                rank)
        claims = _claim.registered_directory()
        capable = _RECOVERY.capability()
        _say_recovery_mode(capable)
        ctl.start(ip, port, claims=None if claims is None else claims.parent, capable=capable)
        _controller = ctl
    log.info("controller process (pid %s) for %d rank(s) listening on %s:%d", _controller.pid,
             world_size, ip, port)


# -- processor ------------------------------------------------------------------------------------
def ttp_init_processor(rank: int, dp_ranks: Sequence[int], dp_size: int, world_size: int,
                       replica: int, enable_local_copy: bool) -> None:
    """Describe this rank: its data-parallel group (global ranks in DP order) and replica."""
    global _processor_args
    world_size = _int("world_size", world_size, 1, MAX_WORLD)
    rank = _int("rank", rank, 0, world_size - 1)
    if isinstance(dp_ranks, (str, bytes)) or not hasattr(dp_ranks, "__iter__"):
        raise ValueError(f"dp_ranks must be a list of global ranks, got {dp_ranks!r}")
    ranks: List[int] = [_int("dp_ranks[]", r, 0, world_size - 1) for r in dp_ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"dp_ranks {ranks} has duplicates: pass each rank of the DP group once")
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in its dp_ranks {ranks}: pass this rank's own DP "
                         "group (mpu.get_data_parallel_all_rank())")
    dp_size = _int("dp_size", dp_size, 1, MAX_WORLD)
    if dp_size != len(ranks):
        raise ValueError(f"dp_size={dp_size} but dp_ranks has {len(ranks)} ranks: pass "
                         "len(dp_ranks)")
    replica = _int("replica", replica, 1, len(ranks),
                   f" (shards per DP group; for DP={len(ranks)} pass len(dp_ranks)//2; DP 1 has "
                   "no replica to save from, use DP >= 2)")
    if len(ranks) % replica:
        raise ValueError(f"replica={replica} shards do not divide the DP group of {len(ranks)} "
                         "ranks (position i holds shard i % replica, so every shard needs as "
                         "many holders): pass len(dp_ranks)//2")
    _check_shards("ttp_init_processor", replica)
    _bool("enable_local_copy", enable_local_copy)
    if _optimizer_order is not None and sorted(_optimizer_order) == sorted(ranks):
        ranks = list(_optimizer_order)  # the optimizer's pairs: place i holds shard i % replica
    _processor_args = (rank, ranks, world_size, replica)


def ttp_start_processor(ip: str, port: int) -> None:
    """Connect this rank to the controller and start its background thread (blocks until
    registered, at most TTP_CONNECT_TIMEOUT)."""
    ip, port = _ip(ip), _port(port)
    if _rejoined() and _processor is not None:
        log.info("ttp_start_processor after an in-memory recovery: the processor runs on")
        return
    start_processor_at(ip, port)


# Said once at start (rank 0) when no launcher offers replacements: today's torchrun and other
# launchers stop the survivors at once after a fault; a user should learn it before one.
NOT_TTPRUN = (
    "not launched by ttprun (TTP_REPLACEMENTS unset): after a fault this launcher stops the "
    "survivors at once (torchrun: SIGTERM, then SIGKILL 30 s later), so you lose the TTP_OT "
    "grace period for the dying checkpoint, and in-memory recovery (no launcher starts a "
    "replacement for a lost rank): launch with ttprun, which takes torchrun's arguments")


def _rejoined() -> bool:
    """This process went through an in-memory recovery: a survivor re-running Megatron's
    start-up, or a replacement (both keep the runtime they have: docs/recovery.md)."""
    return _RECOVERY.order is not None


def start_processor_at(ip: str, port: int, deadline_s: Optional[float] = None) -> None:
    """ttp_start_processor at exactly ip:port (a replacement reaches the acting controller,
    which may be a standby on a port of its own, whatever TTP_CONTROLLER_PORT says);
    `deadline_s`: how long to keep trying to register (a replacement: its order's deadline;
    default TTP_CONNECT_TIMEOUT, see Processor.start)."""
    global _processor
    if _processor_args is None:
        raise TTPError("call ttp_init_processor(rank, dp_ranks, dp_size, world_size, replica, "
                       "False) before ttp_start_processor")
    with _lock:
        if _processor is not None:
            raise TTPError("ttp_start_processor was already called in this process")
        rank, ranks, world_size, replica = _processor_args
        _setup_logging(rank)
        proc = Processor(TTPConfig.from_env(world_size=world_size), rank, ranks, world_size,
                         replica)
        proc.launcher = LauncherDesk(proc.cfg.run_dir, rank)
        proc.start(ip, port, deadline_s)
        _processor = proc
        _mark_started(proc.cfg.run_dir, rank)
        if rank == 0 and not proc.cfg.replacements and _RECOVERY.order is None:
            log.warning(NOT_TTPRUN)
        if _RECOVERY.order is None:  # a replacement never re-arms the launch's drill
            _drill.arm(rank, world_size, proc.cfg.auth_key)
        _hooks.RUNTIME = _RUNTIME
        if threading.current_thread() is threading.main_thread():
            proc.install_sigterm()


def _say_recovery_mode(capable: Tuple[bool, str]) -> None:
    """Log which recovery this job's process groups allow, and leave it for ttprun to print
    (TTP_RUN_DIR/recovery-mode): its own check at start sees the machine, not the groups."""
    cfg_mode = _config_value(os.environ, ENV_RECOVERY)
    said = (f"dying checkpoint ({ENV_RECOVERY}={cfg_mode})" if cfg_mode != RECOVERY_MODES[0]
            else f"in memory where the fault allows ({capable[1]})" if capable[0]
            else f"dying checkpoint, not in memory: {capable[1]}")
    log.warning("recovery mode: %s", said)
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return
    try:
        tmp = os.path.join(run_dir, f".{RECOVERY_MODE_FILE}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(said + "\n")
        os.replace(tmp, os.path.join(run_dir, RECOVERY_MODE_FILE))
    except OSError as exc:
        log.warning("cannot write %s in %s: %s", RECOVERY_MODE_FILE, run_dir, exc)


def _mark_started(run_dir: Optional[str], rank: int) -> None:
    """Tell the launcher (ttprun) that this attempt has a runtime worth holding for TTP_OT."""
    if not run_dir:
        return
    try:
        started = os.path.join(run_dir, RUNTIME_STARTED_DIR)
        os.makedirs(started, exist_ok=True)
        with open(os.path.join(started, f"rank-{rank}"), "w"):
            pass
    except OSError as exc:  # the launcher then stops a failed attempt at once: say so
        log.warning("cannot mark the runtime started in %s (%s): after a fault the launcher "
                    "may not wait for the dying checkpoint", run_dir, exc)


def ttp_register_save_ckpt_handler(fn: Callable[[int, List[int], tuple], None]) -> None:
    HANDLERS["save"] = _handler("ttp_register_save_ckpt_handler", fn, 3,
                                "fn(step, save_ranks, ckpt_args)")
    HANDLERS["device"] = _device.capture()  # the handler threads bind this device (device.py)
    # and read it on a private stream after the last update's event (device_copy.py)
    _device_copy.MARK.install(HANDLERS["device"])


def ttp_register_rename_handler(fn: Callable[[int, tuple], None]) -> None:
    fn = _handler("ttp_register_rename_handler", fn, 2, "fn(step, ckpt_args)")
    locate = getattr(fn, "checkpoint_location", None)
    if locate is not None:
        _handler("ttp_register_rename_handler: its checkpoint_location", locate, 1,
                 "checkpoint_location(step) -> str")
    HANDLERS["rename"] = fn


def ttp_set_checkpoint_dir(path: os.PathLike[str] | str) -> None:
    """Name the directory the save handler writes into (shared by every node), on every rank.
    Not in MindIO's API: it is what lets a job split in two halves save at most one checkpoint.
    Each fault is claimed there by the one controller allowed to order its save
    (faulttime/claim.py), under the launch's fault id, which the primary controller hands every
    rank over the authenticated channel; without a directory a controller saves only with a
    strict majority of the ranks."""
    if not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
        raise ValueError(f"ttp_set_checkpoint_dir takes a directory path, got {path!r}")
    directory = _claim.register(os.path.abspath(os.fspath(path)))
    if _controller is not None:  # already started: it claims faults in its own process
        _controller.set_claims(directory.parent)


def current_save_session() -> Optional[SaveSession]:
    """The save order the running save/rename handler serves: its store, tag and step."""
    return _current_session()


# -- hot path -------------------------------------------------------------------------------------
def ttp_offer_update(step: int, fn: Callable[[], None]) -> None:
    """Not in MindIO's API: call it once the update of `step` is ready (its collectives are
    done, e.g. right after the gradient all-reduce) with `fn` that runs it locally, so a rank
    that leaves the step before its update (the guide's barrier failing for it) can still
    catch up to `step` when the controller allows it. See hooks.offer_update."""
    if not callable(fn):
        raise ValueError(f"ttp_offer_update needs a callable fn(), got {type(fn).__name__}")
    _hooks.offer_update(_int("step", step, 1, 2**62), fn)


def ttp_set_ckpt_args(args: Any) -> None:
    if type(args) is not tuple:
        if not isinstance(args, (tuple, list)):
            raise ValueError(f"ttp_set_ckpt_args takes a tuple (e.g. (iteration, model, "
                             f"optimizer, opt_param_scheduler)), got {type(args).__name__}")
        args = tuple(args)
    _hooks.STATE.ckpt_args = args


def ttp_start_updating_os(backup_step: int) -> None:
    if type(backup_step) is not int or backup_step < -1:
        _int("backup_step", backup_step, -1, 2**63 - 1, " (pass -1: no local copy)")
    _hooks.start_updating_os(backup_step)


def ttp_end_updating_os(step: int) -> None:
    if type(step) is not int or step < 1:
        step = _int("step", step, 1, 2**63 - 1,
                    " (the optimizer step just finished, counted from 1)")
    _hooks.end_updating_os(step)


ttp_to_persist = _hooks.to_persist


def ttp_job_complete(step: int, checkpoint: str = "") -> None:
    """Not in MindIO's API: the job's final state (of `step`) is on disk, complete on every
    rank (say it only past a point every rank reaches after its last write, e.g. the barrier
    that ends Megatron's save_checkpoint). Tells this node's launcher, so that a worker lost
    from now on fails nothing (ttprun ends the job as a success), then stops the runtime: a
    fault after this has nothing left to save. Idempotent; never raises for the record."""
    step = _int("step", step, 0, 2**62)
    run_dir = (_processor.cfg.run_dir if _processor is not None else None) \
        or os.environ.get(ENV_RUN_DIR)
    if run_dir:
        record = {"step": step, "rank": _processor.rank if _processor is not None else None,
                  "checkpoint": checkpoint, "time": time.time()}
        path = os.path.join(run_dir, JOB_COMPLETE_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot record the job's completion in %s (%s): a worker lost from now "
                        "on fails the job at the launcher", run_dir, exc)
    log.info("job complete at step %d%s: the runtime stops", step,
             f" ({checkpoint})" if checkpoint else "")
    ttp_shutdown()


def ttp_shutdown() -> None:
    """Clean stop (also run when the decorated train returns normally)."""
    global _processor, _controller
    with _lock:
        proc, ctl = _processor, _controller
        _processor = _controller = None
        _hooks.RUNTIME = None
        _claim.reset()
        _drill.disarm()
    if proc is not None:
        proc.shutdown()
    if ctl is not None:
        ctl.stop(wait_goodbyes=ctl.cfg.deadlines.goodbye_wait)
    _hooks.STATE.reset()


class _Runtime:
    """What the decorator needs from the started runtime."""

    @property
    def running(self) -> bool:
        return _processor is not None and _processor.running

    @property
    def fault_seen(self) -> bool:
        return _processor is not None and _processor.fault_seen

    @property
    def ot(self) -> float:
        return _processor.ot if _processor is not None else 0.0

    def report_exception(self, exc: BaseException, kind: str = "") -> None:
        if _processor is not None:
            _processor.report_exception(exc, kind)

    @property
    def recovery_ordered(self) -> bool:
        """A survivor's in-memory recovery was ordered (hooks: leave train() to rejoin)."""
        return _RECOVERY.pending

    def wait_for_exit(self, timeout: float) -> bool:
        return _processor.wait_for_exit(timeout) if _processor is not None else True

    def shutdown(self) -> None:
        ttp_shutdown()


_RUNTIME = _Runtime()
