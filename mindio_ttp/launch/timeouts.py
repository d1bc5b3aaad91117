"""ttprun's check that the workers' process-group timeout outlasts TTP_OT, read from the tree.

A survivor of a fault usually sits in a collective with the dead peer; that collective fails
when the process group's timeout runs out, and with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` the
watchdog then aborts the communicators, in the middle of the dying save if TTP_OT is that long.
Where the timeout comes from depends on the Megatron-LM the script belongs to, so ttprun reads
the tree beside the script (``megatron/initialize.py``, ``megatron/arguments.py``) instead of
guessing from the command line:

* a tree patched by ``ttp-patch`` (edit 6.2) asks the runtime, which never gives less than
  TTP_OT needs: nothing to say;
* Megatron-LM 285068c unpatched there (the guide's edits only) hard-codes 10 minutes and has no
  flag to change it: the advice is to apply ttp-patch or lower TTP_OT;
* later Megatron-LM reads ``--distributed-timeout-minutes`` (default 10): the advice is the flag.

The rule (TTP_OT plus :data:`mindio_ttp.config.PG_TIMEOUT_MARGIN_S`) is the one the patched tree
applies, from :mod:`mindio_ttp.config`. A tree that cannot be read says nothing: a warning must
be true.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from mindio_ttp.config import ENV_OT, PG_TIMEOUT_MARGIN_S, process_group_timeout_s

FLAG = "--distributed-timeout-minutes"
RUNTIME_CALL = "process_group_timeout"  # mindio_ttp.megatron_ttp's, which edit 6.2 calls


@dataclass(frozen=True)
class GroupTimeout:
    """The workers' process-group timeout: seconds (None: follows TTP_OT), where it comes
    from, and how this tree lets a user raise it."""

    seconds: Optional[float]
    source: str
    how_to_raise: str


def _flag_minutes(script_args: Sequence[str]) -> Optional[str]:
    args = list(script_args)
    for i, arg in enumerate(args):
        if arg == FLAG and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def _tree_of(script: str, is_module: bool) -> Optional[Path]:
    """The ``megatron`` package beside the entry script, if there is one."""
    if is_module:
        return None
    megatron = Path(script).resolve().parent / "megatron"
    return megatron if megatron.is_dir() else None


def _knows_flag(megatron: Optional[Path]) -> Optional[bool]:
    """Whether this Megatron-LM has the flag (None: cannot tell)."""
    arguments = megatron / "arguments.py" if megatron is not None else None
    if arguments is None or not arguments.is_file():
        return None
    return FLAG in arguments.read_text(encoding="utf-8", errors="replace")


def _minutes_of(node: Optional[ast.expr]) -> Optional[float]:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    return None


def _flag_default_minutes(arguments: Path) -> Optional[float]:
    """The default of ``--distributed-timeout-minutes`` in Megatron's argparse setup."""
    try:
        tree = ast.parse(arguments.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == FLAG):
            for kw in node.keywords:
                if kw.arg == "default":
                    return _minutes_of(kw.value)
    return None


def _initialize_timeout(initialize: Path) -> Optional[ast.expr]:
    """The ``timeout=`` expression of the tree's ``init_process_group`` call."""
    try:
        tree = ast.parse(initialize.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "init_process_group":
                return next((kw.value for kw in node.keywords if kw.arg == "timeout"), None)
    return None


def group_timeout(script: str, script_args: Sequence[str],
                  is_module: bool = False) -> Optional[GroupTimeout]:
    """What the workers' process groups will wait, or None when the tree does not say."""
    megatron = _tree_of(script, is_module)
    knows_flag = _knows_flag(megatron)
    raw = _flag_minutes(script_args)
    if raw is not None and knows_flag is not False:
        try:
            minutes = float(raw)
        except ValueError:
            return None
        return GroupTimeout(minutes * 60.0, f"{FLAG} {raw}", f"pass {FLAG} {{minutes}} or more")
    if megatron is None or not (megatron / "initialize.py").is_file():
        return None
    expr = _initialize_timeout(megatron / "initialize.py")
    if not isinstance(expr, ast.Call):
        return None
    func = expr.func
    if isinstance(func, ast.Attribute) and func.attr == RUNTIME_CALL:
        return GroupTimeout(None, "megatron/initialize.py as ttp-patch writes it (follows "
                            f"{ENV_OT})", "")
    if not (isinstance(func, ast.Name) and func.id == "timedelta"):
        return None
    value = next((kw.value for kw in expr.keywords if kw.arg == "minutes"), None)
    minutes = _minutes_of(value)
    if minutes is not None:
        return GroupTimeout(minutes * 60.0, f"hard-coded in {megatron / 'initialize.py'}",
                            "run `ttp-patch apply` on this tree (its edit 6.2 makes the timeout "
                            f"follow {ENV_OT})")
    if knows_flag:  # timedelta(minutes=args.distributed_timeout_minutes), flag not given
        default = _flag_default_minutes(megatron / "arguments.py")
        if default is not None:
            return GroupTimeout(default * 60.0, f"Megatron's default {FLAG} ({default:g})",
                                f"pass {FLAG} {{minutes}} or more")
    return None


def timeout_warning(script: str, script_args: Sequence[str], ot_s: float,
                    is_module: bool = False) -> Optional[str]:
    """A warning, with advice this tree accepts, when the process groups give up before the
    survivors' grace period TTP_OT (plus the margin) ends; None when they do not, or when the
    tree does not say. Also when ``--distributed-timeout-minutes`` is given to a Megatron-LM that
    does not know it (it would exit with "unrecognized arguments")."""
    megatron = _tree_of(script, is_module)
    if _flag_minutes(script_args) is not None and _knows_flag(megatron) is False:
        assert megatron is not None
        return (f"{FLAG} is not an argument of the Megatron-LM in {megatron.parent} (it came after "
                f"285068c): Megatron will exit with 'unrecognized arguments'; drop it (a tree "
                f"patched by ttp-patch takes its process-group timeout from {ENV_OT})")
    found = group_timeout(script, script_args, is_module)
    if found is None or found.seconds is None:
        return None
    need = process_group_timeout_s(ot_s, floor_s=0.0)
    if found.seconds >= need:
        return None
    most = max(0.0, found.seconds - PG_TIMEOUT_MARGIN_S)
    advice = found.how_to_raise.format(minutes=math.ceil(need / 60.0))
    return (f"the workers' process-group timeout ({found.seconds:.0f} s, {found.source}) ends "
            f"before {ENV_OT} ({ot_s:.0f} s) plus {PG_TIMEOUT_MARGIN_S:.0f} s for the fault's "
            "detection: a survivor's collective hung on a lost rank fails (and the NCCL watchdog "
            f"aborts) in the middle of the dying checkpoint; {advice}, or lower {ENV_OT} to at "
            f"most {most:.0f} s")
