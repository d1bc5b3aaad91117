"""In-memory recovery, Megatron's side: survivors re-enter Megatron's start-up around the state
they hold; a replacement runs it from scratch; both meet on the recovery's store.

Two decorators, put on the patched tree by ttp-patch (edits R.1, R.2):

* `@mega.in_memory_recovery` on `pretrain`: runs it; when the decorated `train` raises
  `TTPRecovering` (the controller ordered a recovery), stops this process's device work,
  destroys every process group, forgets Megatron's global state and runs `pretrain` again,
  whose `init_process_group` then rendezvous on the recovery's namespace of the authenticated
  store (`mega.process_group_store`, edit 6.3). In a replacement process (``TTP_RECOVERY_JOIN``
  set by the launcher) the first run already is the recovery's; it registers with the acting
  controller first, so it can reach that store.
* `@mega.reuse_on_recovery` on `get_model`: during a survivor's re-run, returns the model the
  survivor holds, after the one collective its construction made (the pipeline's embedding
  all-reduce), instead of building a new one. `ReplicatedOptimizer` does the same for itself
  (`ReplicatedOptimizer.__new__`), re-creating its pair groups.

Why re-run the start-up rather than rejoin inside `train()`: the replacement runs Megatron's
whole start-up, and each of its collectives (barriers, timing reductions, the data loaders'
broadcasts, the embedding all-reduce) needs its counterpart on the survivors. The same code on
both sides gives every one its counterpart, for whatever start-up the tree has; a survivor
skips only the construction of what it already holds. The patched loader
(`mega.load_checkpoint`) then refills and rolls back in memory (refill.py).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, TypeVar

from mindio_ttp import hooks
from mindio_ttp.faulttime import device_copy
from mindio_ttp.hooks import TTPRecovering
from mindio_ttp.megatron_ttp import completion
from mindio_ttp.recovery.machine import RecoveryState as S
from mindio_ttp.recovery.rank import (
    RECOVERY,
    REPLACEMENT,
    SURVIVOR,
    RecoveryOrder,
    RecoveryRefused,
    join_order,
    parse_address,
)

log = logging.getLogger("mindio_ttp.recovery")
F = TypeVar("F", bound=Callable[..., Any])

# megatron.global_vars' module state, which set_global_variables refuses to set twice
_MEGATRON_GLOBALS = ("_GLOBAL_ARGS", "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", "_GLOBAL_TOKENIZER",
                     "_GLOBAL_TENSORBOARD_WRITER", "_GLOBAL_ADLR_AUTORESUME", "_GLOBAL_TIMERS",
                     "_GLOBAL_SIGNAL_HANDLER")


@dataclass
class Rejoin:
    """One recovery as this process runs it: its order, its role, what a survivor keeps."""

    order: RecoveryOrder
    role: str
    rank: int
    model: Any = None  # survivor: its model chunks, returned by get_model
    optimizer: Any = None  # survivor: its ReplicatedOptimizer, returned by its constructor
    scheduler_state: Optional[dict] = None  # survivor: its scheduler's state before the re-run
    model_reused: bool = False
    optimizer_reused: bool = False
    model_groups: Optional[list] = None  # (module, attribute, mpu getter) of held groups
    args: Any = None  # survivor: Megatron's arguments before the re-run


_current: Optional[Rejoin] = None


def current() -> Optional[Rejoin]:
    """The recovery this process is in, while it is in one (None once committed)."""
    return _current if _current is not None and RECOVERY.active else None


def megatron_args() -> Any:
    """Megatron's arguments; between a survivor's leaving the world and its re-run parsing them
    again (when a fallback to the dying checkpoint may need them), the ones it trained with."""
    from megatron import get_args

    try:
        return get_args()
    except AssertionError:
        if _current is not None and _current.args is not None:
            return _current.args
        raise


def finished() -> None:
    global _current
    _current = None


# -- capability: can this process's job recover in memory at all? --------------------------------
def capability() -> Tuple[bool, str]:
    import megatron.training as training
    from megatron import get_args

    try:
        args = get_args()
    except (AssertionError, RuntimeError):
        return False, "Megatron's arguments are not parsed yet"
    if not getattr(training.get_model, "_ttp_reuses_on_recovery", False):
        return False, ("megatron/training.py's get_model lacks @mega.reuse_on_recovery (run "
                       "`ttp-patch apply` again)")
    import megatron.initialize as initialize

    if "process_group_store" not in initialize._initialize_distributed.__code__.co_names:
        return False, ("megatron/initialize.py's init_process_group lacks "
                       "store=mega.process_group_store() (run `ttp-patch apply` again)")
    if args.load is None:
        return False, ("Megatron runs without --load (the patched loader, called only with "
                       "--load, is where a recovery refills the state)")
    if not args.use_distributed_optimizer:
        return False, "the replicated optimizer needs --use-distributed-optimizer"
    return stack_capability()


def stack_capability() -> Tuple[bool, str]:
    """Whether the default group's backends can be stopped and re-initialised in process
    (`features.recovery_support`: abort a collective another thread waits in, build new groups
    after it); where not, the job uses the dying checkpoint (docs/stack.md)."""
    import torch.distributed as dist

    from mindio_ttp.compat import features
    from mindio_ttp.faulttime import abort

    if not dist.is_initialized():
        return False, "torch.distributed is not initialised yet"
    default = dist.distributed_c10d._get_default_group()
    said = []
    for name, backend in abort._backends(default):
        ok, why = features.recovery_support(name, backend)
        if not ok:
            return False, why
        said.append(why)
    return True, "; ".join(said)


# -- @mega.in_memory_recovery on pretrain ---------------------------------------------------------
def in_memory_recovery(pretrain: F) -> F:
    """Run `pretrain`; run it again in this process after each in-memory recovery."""

    @functools.wraps(pretrain)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _current
        RECOVERY.capability = capability
        completion.hold_runtime()  # up to the final save, not train()'s return
        joined = join_order()
        if joined is not None:  # a replacement: this first run is the recovery's
            order, rank = joined
            RECOVERY.joining(order)
            _current = Rejoin(order, REPLACEMENT, rank)
            try:
                _register_replacement(order, rank)
            except BaseException as exc:
                _fail_and_wait(exc)
                raise
            RECOVERY.machine.transition_to(S.REGROUPING, f"new world on {order.store}")
        while True:
            try:
                result = pretrain(*args, **kwargs)
            except TTPRecovering:
                pass  # leave the except block first: its traceback holds the old groups
            except BaseException as exc:
                # out of the step (pretrain's own work after train(), held: completion.py):
                # the release (control/rank/release.py) must stop raising into this thread
                hooks.TRAINING.leave()
                if not _hold_for_verdict(exc):
                    raise
            else:
                completion.release_runtime()
                return result
            try:
                _survivor_leaves_the_world()
            except BaseException as exc:
                _fail_and_wait(exc)
                raise

    return wrapper  # type: ignore[return-value]


def _survivor_leaves_the_world() -> None:
    """Stop, destroy every group, forget Megatron's globals: the re-run builds anew. The
    survivor's record (`_current`) is kept from the start: should the recovery be abandoned
    on the way, the fallback's save and rename still need the arguments it trained with."""
    global _current
    order = RECOVERY.order
    assert order is not None and RECOVERY.machine.state is S.ORDERED, RECOVERY.machine.state
    RECOVERY.machine.transition_to(S.STOPPING, "left train()")
    ckpt = hooks.STATE.ckpt_args
    if len(ckpt) != 4:
        raise RuntimeError("no training state registered (ttp_set_ckpt_args): nothing to "
                           "recover from")
    _, model, optimizer, scheduler = ckpt
    if getattr(optimizer, "current_step", None) != order.step:
        raise RuntimeError(f"this rank holds step {getattr(optimizer, 'current_step', None)}, "
                           f"not the recovery's step {order.step}")
    import torch.distributed as dist
    from megatron import get_args

    rejoin = _current = Rejoin(order, SURVIVOR, dist.get_rank(), model, optimizer,
                               dict(scheduler.state_dict()), args=get_args())
    _destroy_groups(rejoin)
    _forget_megatron_globals()
    RECOVERY.machine.transition_to(S.REGROUPING, f"new world on {order.store}")


def _register_replacement(order: RecoveryOrder, rank: int) -> None:
    """A replacement joins the control plane first, at the acting controller (maybe a standby
    on a port of its own): the new world's rendezvous is reached through that connection. It
    keeps trying until its order's deadline (a listener full of an outsider's connections
    makes room, control/wire/admission.py; giving up would end the recovery)."""
    from mindio_ttp import framework_ttp as ttp

    world_size = int(os.environ["WORLD_SIZE"])
    dp = list(order.dp_ranks)
    ttp.ttp_init_processor(rank, dp, len(dp), world_size, len(dp) // 2, False)
    ttp.start_processor_at(*parse_address(order.controller), deadline_s=order.deadline_s)


def process_group_store() -> Any:
    """What megatron/initialize.py passes to `init_process_group` as `store` (edit 6.3): None
    (torch's env:// rendezvous) outside a recovery; in one, the recovery's namespace of the
    authenticated store, reached over this rank's TTP connection."""
    job = current()
    if job is None:
        return None
    from mindio_ttp.control.rank.authstore import AuthStore

    return AuthStore(job.order.store, timeout=job.order.deadline_s)


def _destroy_groups(rejoin: Rejoin) -> None:
    """Stop the device's work (the fault's stop, usually done by the processor at the lock:
    faulttime/device_copy.STOP), destroy every group, bounded, check the device (bounded), and
    drop every reference to the groups: on gloo, the last one closes the group's sockets, which
    fails a survivor's collective still waiting for this rank (it then leaves its step too).
    The model holds some (ParallelTransformer.fp8_group): detached here, re-attached to the new
    groups when get_model hands the model back. Raises (the caller fails the recovery at once,
    and the controller falls back to the dying checkpoint) when the abort did not work, the
    destroy does not return, or the device does not drain: re-initialising beside a hung
    kernel or a stuck abort thread leaks the communicator and can hang the next destroy."""
    import torch.distributed as dist
    from megatron.core import mpu

    from mindio_ttp import config
    from mindio_ttp.faulttime import abort
    from mindio_ttp.faulttime.device import health_check

    binding = device_copy.MARK.binding
    report = device_copy.STOP.run(config.ABORT_TIMEOUT_S, binding)
    log.warning("recovery: %s", report.describe())
    if not report.ok:
        raise RuntimeError(f"the communicators were not all aborted ({report.describe()})")
    rejoin.model_groups = _detach_model_groups(rejoin.model)
    alive = [(weakref.ref(pg), name) for pg, name in
             dict(getattr(dist.distributed_c10d._world, "pg_names", {})).items()]
    def late() -> None:  # the destroy still waits: fail the recovery now, not at its bound
        why = f"destroy_process_group did not return within {config.ABORT_TIMEOUT_S:g} s"
        RECOVERY.report_ready(False, why)
        RECOVERY.abandon(why)

    if dist.is_initialized() and not abort.destroy_groups(config.ABORT_TIMEOUT_S, late):
        raise RuntimeError(f"destroy_process_group failed or did not return within "
                           f"{config.ABORT_TIMEOUT_S:g} s")
    mpu.destroy_model_parallel()
    rejoin.optimizer.pair_group = None
    # a new world: the last param all-gather's work handles hold the old groups (on gloo,
    # their sockets: a peer still waiting on them hangs); without them, a fallback save
    # rebuilds the model file from the main params, which it may always do
    device_copy.STOP.reset()
    sick = health_check(binding, config.ABORT_TIMEOUT_S)
    if sick:
        raise RuntimeError(f"the device is not healthy after the abort: {sick}")
    _release_default_arguments(dist.ProcessGroup)
    gc.collect()
    held = [(ref(), name) for ref, name in alive if ref() is not None]
    if held:  # on gloo its sockets stay open: a peer waiting on it hangs
        # Naming the holders walks the whole heap per group (gc.get_referrers, 3 deep): about
        # 2 s a group on the tiny GPT under the NCCL-like rig, which keeps its groups, 15 s of
        # a recovery; only at DEBUG, never on the recovery's path by default.
        debug = log.isEnabledFor(logging.DEBUG)
        log.warning("recovery: %d process group(s) still referenced after their destruction "
                    "(%s)%s", len(held), ", ".join(str(name) for _, name in held),
                    "" if debug else "; TTP_LOG_LEVEL=DEBUG names their holders")
        if debug:
            for pg, name in held:
                log.debug("recovery: process group %s is held by %s", name, _referrers(pg))
    del held


def _release_default_arguments(kind: type) -> None:
    """Functions whose default arguments hold a process group: torch.distributed.nn.functional
    writes `group=group.WORLD`, bound to the default group when the module is imported after
    `init_process_group` (pipeline parallelism does, here). That reference alone keeps the old
    world's sockets open; None means the default group to those functions."""
    import types

    for fn in gc.get_objects():
        if not isinstance(fn, types.FunctionType):
            continue
        if fn.__defaults__ and any(isinstance(d, kind) for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if isinstance(d, kind) else d for d in fn.__defaults__)
        if fn.__kwdefaults__ and any(isinstance(d, kind) for d in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if isinstance(d, kind) else d
                                 for k, d in fn.__kwdefaults__.items()}


def _referrers(obj: Any, depth: int = 3) -> str:
    """Who holds `obj` (for the warning above): attributes, frames, closures, containers."""
    import types

    out = []
    for ref in gc.get_referrers(obj):
        if isinstance(ref, dict):
            out += [f"attribute {k!r}" for k, v in ref.items() if v is obj]
        elif isinstance(ref, types.FrameType):
            out.append(f"frame of {ref.f_code.co_name} ({ref.f_code.co_filename}:"
                       f"{ref.f_lineno})")
        elif isinstance(ref, types.FunctionType):
            out.append(f"function {ref.__qualname__} ({ref.__code__.co_filename})")
        elif isinstance(ref, types.CellType) or isinstance(ref, tuple):
            inner = _referrers(ref, depth - 1) if depth > 0 else "..."
            out.append(f"{type(ref).__name__} in [{inner}]")
        elif not isinstance(ref, list):  # lists: gc.get_referrers' own results
            out.append(type(ref).__name__)
    for fn in gc.get_objects():  # closures holding it, directly or in a tuple
        if isinstance(fn, types.FunctionType) and fn.__closure__:
            for cell in fn.__closure__:
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if v is obj or (isinstance(v, (tuple, list)) and any(x is obj for x in v)):
                    out.append(f"closure of {fn.__qualname__} ({fn.__code__.co_filename})")
        elif isinstance(fn, types.GeneratorType) and fn.gi_frame is not None:
            if any(v is obj for v in fn.gi_frame.f_locals.values()):
                out.append(f"generator {fn.__qualname__}")
    return ", ".join(out[:8]) or "a running frame or native code"


# which mpu getter gives each group a module may hold, in the order to try them (the first that
# is the held object names it: in DP4 the data-parallel group has the ranks of the world, but it
# is its own object)
_GROUP_GETTERS = ("get_data_parallel_group", "get_tensor_model_parallel_group",
                  "get_pipeline_model_parallel_group", "get_model_parallel_group",
                  "get_embedding_group", "get_position_embedding_group")


def _detach_model_groups(model: Any) -> list:
    """[(module, attribute, mpu getter)] for every process group a module of `model` holds,
    each attribute set to None."""
    import torch.distributed as dist
    from megatron.core import mpu

    known = {}
    for getter in _GROUP_GETTERS:
        try:
            known.setdefault(id(getattr(mpu, getter)()), getter)
        except (AssertionError, AttributeError, RuntimeError):
            continue
    found = []
    for chunk in model:
        for module in chunk.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, dist.ProcessGroup):
                    getter = known.get(id(value))
                    if getter is None:
                        raise RuntimeError(f"{type(module).__name__}.{name} holds a process "
                                           "group that is none of Megatron's: cannot rebuild it")
                    found.append((module, name, getter))
                    setattr(module, name, None)
    return found


def _attach_model_groups(found: list) -> None:
    from megatron.core import mpu

    for module, name, getter in found:
        setattr(module, name, getattr(mpu, getter)())


def _forget_megatron_globals() -> None:
    import megatron.global_vars as gv

    handler = getattr(gv, "_GLOBAL_SIGNAL_HANDLER", None)
    if handler is not None:
        handler.__exit__(None, None, None)  # give SIGTERM back (TTP's handler stays first)
    writer = getattr(gv, "_GLOBAL_TENSORBOARD_WRITER", None)
    if writer is not None:
        writer.close()
    for name in _MEGATRON_GLOBALS:
        if hasattr(gv, name):
            setattr(gv, name, None)


def _hold_for_verdict(exc: BaseException) -> bool:
    """An exception out of `pretrain` (its start-up, `train`, its final evaluation or save)
    with the runtime running: like the decorated `train` does, report it and wait for the
    controller's verdict (the process ends on the exit order). True when the verdict is an
    in-memory recovery instead (a fault right after a recovery, while Megatron rebuilds its
    data loaders, say, or one in the final evaluation or save)."""
    rt = hooks.RUNTIME
    if isinstance(exc, hooks.TTPReleased):  # raised into the decorator's own handler: it has
        hooks.TRAINING.leave()  # left the failed step all the same (control/rank/release.py)
        if rt is not None and rt.running and RECOVERY.pending:
            return True
    if rt is None or not rt.running or getattr(exc, "_ttp_waited", False):
        return False
    if RECOVERY.pending:  # ordered while this rank was still in the old world (after train(),
        # in pretrain's final evaluation or save): this exception, a collective that lost its
        # peer, is how it leaves; the recovery is under way, so nothing to report
        log.warning("in-memory recovery ordered: leaving pretrain (%r) to rejoin", exc)
        return True
    if RECOVERY.active:
        _fail_and_wait(exc)
        return False
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) and not rt.fault_seen:
        return False
    log.error("exception in Megatron's start-up or train(): %r; reporting it and waiting for "
              "the controller's verdict", exc)
    hooks._shielded(rt.report_exception, exc)
    try:
        hooks._wait_for_verdict(rt)
    except TTPRecovering:
        return True
    return False


def _fail_and_wait(exc: BaseException) -> None:
    """A step of the recovery failed here: say so (the controller falls back to the dying
    checkpoint), then wait for the exit order like after any fault. This rank's own exception
    (not a collective that lost its peer, not a verdict every rank shares) is reported as a
    fault first, on the same connection: the fallback must not pick this rank to save (a
    device error may be behind it), and the controller learns it before the READY."""
    log.error("in-memory recovery failed on this rank: %r", exc)
    rt = hooks.RUNTIME
    own = not RECOVERY.abandoned and not isinstance(exc, (RecoveryRefused, hooks.TTPReleased)) \
        and hooks.fault_kind(exc, False) == "exception"
    if own and rt is not None and rt.running:
        hooks._shielded(rt.report_exception, exc, "exception")
    RECOVERY.report_ready(False, f"{type(exc).__name__}: {exc}")
    RECOVERY.abandon(f"failed here: {exc!r}"[:300])
    if rt is not None and rt.running:
        try:
            hooks._wait_for_verdict(rt)
        except TTPRecovering:
            pass


# -- @mega.reuse_on_recovery on get_model ---------------------------------------------------------
def reuse_on_recovery(get_model: F) -> F:
    """During a survivor's re-run, `get_model` returns the model the survivor holds."""

    @functools.wraps(get_model)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rejoin = current()
        if rejoin is None or rejoin.role != SURVIVOR or rejoin.model_reused:
            return get_model(*args, **kwargs)
        rejoin.model_reused = True
        _adopt_model_arguments(rejoin.args)
        _attach_model_groups(rejoin.model_groups or [])
        mirror_model_construction(rejoin.model)
        return rejoin.model

    wrapper._ttp_reuses_on_recovery = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _adopt_model_arguments(old: Any) -> None:
    """What building the model wrote into Megatron's arguments (get_model sets `model_type`,
    `allow_transformer_engine`): the survivor's previous arguments hold it; the fresh ones lack
    it. Only absent attributes are taken: everything parsed stays as parsed now."""
    from megatron import get_args

    args = get_args()
    for name, value in vars(old).items():
        if not hasattr(args, name):
            setattr(args, name, value)


def mirror_model_construction(model: Any) -> None:
    """The collectives a model chunk's construction makes, with throw-away copies:
    `MegatronModule.initialize_word_embeddings` (megatron/model/module.py:102-119) all-reduces
    the word embeddings between the first and last pipeline stage, and the position embeddings
    with the split stage. A replacement at either end waits for its peer's part."""
    import torch
    from megatron import get_args
    from megatron.core import mpu
    from megatron.model import DistributedDataParallel as LocalDDP
    from megatron.model import Float16Module
    from megatron.utils import unwrap_model
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    args = get_args()
    if args.pipeline_model_parallel_size == 1:
        return
    chunks = unwrap_model(model, (TorchDDP, LocalDDP, Float16Module))
    for i, chunk in enumerate(chunks):
        if len(chunks) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(i)
        if not getattr(chunk, "share_word_embeddings", False):
            continue
        if mpu.is_rank_in_embedding_group():
            torch.distributed.all_reduce(chunk.word_embeddings_weight().data.clone(),
                                         group=mpu.get_embedding_group())
        if mpu.is_rank_in_position_embedding_group() and \
                args.pipeline_model_parallel_split_rank is not None:
            weight = chunk.language_model.embedding.position_embeddings.weight
            torch.distributed.all_reduce(weight.data.clone(),
                                         group=mpu.get_position_embedding_group())


def kept_optimizer() -> Any:
    """The survivor's optimizer, once, for ReplicatedOptimizer.__new__ during its re-run."""
    rejoin = current()
    if rejoin is None or rejoin.role != SURVIVOR or rejoin.optimizer_reused:
        return None
    rejoin.optimizer_reused = True
    return rejoin.optimizer
