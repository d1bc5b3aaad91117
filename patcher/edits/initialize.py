"""Edits 6.1-6.3 (ttp-patch's, not the guide's): megatron/initialize.py takes its process-group
timeout (6.2) and, during an in-memory recovery, its rendezvous store (6.3) from the runtime.

Megatron-LM 285068c hard-codes 10 minutes (`_initialize_distributed`, lines 174-177) and has no
`--distributed-timeout-minutes` yet, so with TTP_OT of 10 minutes or more the NCCL watchdog
aborted the survivors' communicators in the middle of the dying save, and no flag could say
otherwise. The patched call keeps Megatron's 10 minutes unless TTP_OT needs more
(`mindio_ttp.megatron_ttp.process_group_timeout`).
"""

from __future__ import annotations

import ast
from typing import Optional, Tuple, Union

import libcst as cst

from ..options import Options
from .base import Assessment, Edit, FileIndex, InsertAfterAnchor, Op, Site, State, where
from .statements import EMPTY_MODULE

FILE = "megatron/initialize.py"


class ImportGlue(InsertAfterAnchor):
    """After `from datetime import timedelta`; the glue module imports nothing eagerly, so
    megatron/__init__.py (which imports this file) is not re-entered."""

    id = "initialize/import-ttp"
    number = "6.1"
    file = FILE
    scope = None
    anchor = "from datetime import timedelta"
    inserted = "import mindio_ttp.megatron_ttp as mega\n"
    summary = "import mindio_ttp.megatron_ttp as mega (ttp-patch's, not the guide's)"


def _timeout_arg(stmt: cst.BaseStatement) -> Optional[ast.expr]:
    """The `timeout=` expression of a statement that is one call."""
    tree = ast.parse(EMPTY_MODULE.code_for_node(stmt))
    call = tree.body[0].value if isinstance(tree.body[0], ast.Expr) else None
    if not isinstance(call, ast.Call):
        return None
    return next((kw.value for kw in call.keywords if kw.arg == "timeout"), None)


def _is_timedelta(expr: Optional[ast.expr]) -> bool:
    return isinstance(expr, ast.Call) and ast.unparse(expr.func) == "timedelta"


class TimeoutFromRuntime(Edit):
    """Wraps the `timeout=timedelta(...)` of the one `init_process_group` call. Any timedelta:
    285068c's `minutes=10`, and a later Megatron's `minutes=args.distributed_timeout_minutes`
    (patched with --allow-modified), which then stays the floor the runtime raises."""

    id = "initialize/pg-timeout"
    number = "6.2"
    file = FILE
    scope = "_initialize_distributed"
    anchor = (
        "torch.distributed.init_process_group(\n"
        "    backend=args.distributed_backend,\n"
        "    world_size=args.world_size, rank=args.rank,\n"
        "    timeout=timedelta(minutes=10))"
    )
    summary = "process-group timeout at least TTP_OT + margin (ttp-patch's, not the guide's)"

    def anchor_text(self) -> str:
        return "torch.distributed.init_process_group(..., timeout=timedelta(...))"

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        site = _the_call(index, self.scope)
        if isinstance(site, Assessment):
            return site
        timeout = _timeout_arg(site.stmt)
        if (isinstance(timeout, ast.Call) and ast.unparse(timeout.func) == _RUNTIME_CALL
                and len(timeout.args) == 1 and _is_timedelta(timeout.args[0])):
            return Assessment(State.APPLIED)
        if _is_timedelta(timeout):
            return Assessment(State.MISSING, ops=[Op(site.block, site.index, rewrite=_wrap)])
        return Assessment(
            State.DRIFTED,
            f"{where(self.scope)}: init_process_group's timeout is neither timedelta(...) nor "
            f"{_RUNTIME_CALL}(timedelta(...))",
        )


_CALL_SHAPE = "call torch.distributed.init_process_group"


def _the_call(index: FileIndex, scope: Optional[str]) -> Union[Site, Assessment]:
    """The one `init_process_group(...)` statement of `scope`, or why the edit drifted."""
    calls = [s for s in index.simple(scope) if index.shape(s.stmt) == _CALL_SHAPE]
    if len(calls) != 1:
        how = "not found" if not calls else f"found {len(calls)} times"
        return Assessment(State.DRIFTED, f"init_process_group(...) {how} {where(scope)}")
    return calls[0]
_RUNTIME_CALL = "mega.process_group_timeout"


def _wrap(stmt: cst.BaseStatement) -> cst.BaseStatement:
    from .rewrites import TimeoutFromRuntime as Wrap

    return stmt.visit(Wrap())


def _store_arg(stmt: cst.BaseStatement) -> Tuple[bool, Optional[ast.expr]]:
    """(is one call, its `store=` expression)."""
    tree = ast.parse(EMPTY_MODULE.code_for_node(stmt))
    call = tree.body[0].value if isinstance(tree.body[0], ast.Expr) else None
    if not isinstance(call, ast.Call):
        return False, None
    return True, next((kw.value for kw in call.keywords if kw.arg == "store"), None)


class StoreFromRuntime(Edit):
    """`store=mega.process_group_store()` on the one `init_process_group` call: None (torch's
    env:// rendezvous, as without it) except while a survivor runs Megatron's start-up again in
    an in-memory recovery, or a replacement runs it for the first time: then the recovery's
    namespace of the authenticated store (control/rank/authstore.py), which env:// cannot reach."""

    id = "initialize/pg-store"
    number = "6.3"
    file = FILE
    scope = "_initialize_distributed"
    anchor = TimeoutFromRuntime.anchor
    summary = "rendezvous store from the runtime in a recovery (ttp-patch's, not the guide's)"

    def anchor_text(self) -> str:
        return "torch.distributed.init_process_group(...)"

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        site = _the_call(index, self.scope)
        if isinstance(site, Assessment):
            return site
        _, store = _store_arg(site.stmt)
        if store is None:
            return Assessment(State.MISSING, ops=[Op(site.block, site.index, rewrite=_add_store)])
        if ast.unparse(store) == f"{_STORE_CALL}()":
            return Assessment(State.APPLIED)
        return Assessment(State.DRIFTED, f"{where(self.scope)}: init_process_group already has "
                          f"store={ast.unparse(store)}, not {_STORE_CALL}()")


_STORE_CALL = "mega.process_group_store"


def _add_store(stmt: cst.BaseStatement) -> cst.BaseStatement:
    from .rewrites import StoreFromRuntime as Add

    return stmt.visit(Add())


EDITS = [ImportGlue(), TimeoutFromRuntime(), StoreFromRuntime()]
