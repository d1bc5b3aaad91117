"""What ttprun checks before any worker starts, and what its --help ends with.

One pass over the environment with the runtime's own table (mindio_ttp/config.py), so a bad
value is refused here, once, with every problem in one message and exit 2, instead of in every
rank after the model is built and the data loaded. Warnings (settings that are legal but
defeat the dying checkpoint, misspelt names) go to stderr and the launch goes on.
"""

from __future__ import annotations

import importlib.util
import textwrap
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from mindio_ttp import config
from mindio_ttp.config import ENV_AUTH_KEY, ENV_AUTH_KEY_FILE, ExitCode
from mindio_ttp.faulttime import collective_env
from mindio_ttp.launch import timeouts
from mindio_ttp.launch.outcome import CheckpointArgs

MULTI_NODE_KEY_MESSAGE = (
    "a multi-node job needs a control-plane key that every node already has: export "
    f"{ENV_AUTH_KEY}=<64 hex chars> on every node (e.g. generate it once with `python -c "
    "'import secrets; print(secrets.token_hex(32))'` and pass it through your scheduler's "
    f"secret store), or point {ENV_AUTH_KEY_FILE} at a chmod-600 file on every node. ttprun "
    "does not send keys over the network."
)


def check(env: Mapping[str, str], multi_node: bool, script_args: Sequence[str] = (),
          script: str = "", is_module: bool = False) -> Tuple[List[str], List[str]]:
    """(problems, warnings): any problem means nothing may start. `script` is the training
    script (a module name with `is_module`): the process-group timeout is read from its tree."""
    problems = config.problems(env)
    if multi_node and not (env.get(ENV_AUTH_KEY) or env.get(ENV_AUTH_KEY_FILE)):
        problems.append(MULTI_NODE_KEY_MESSAGE)
    warnings = config.unknown_names(env) + collective_env.user_value_warnings(env)
    try:
        timeout = timeouts.timeout_warning(script, script_args, config.overtime_s(env),
                                           is_module=is_module or not script)
    except ValueError:
        timeout = None  # TTP_OT itself is among the problems
    if timeout:
        warnings.append(timeout)
    warnings += CheckpointArgs.parse(script_args).start_warnings()
    return problems, warnings


def _stack() -> Tuple[str, Any, str]:
    """(backend, its ProcessGroup class or None, what was seen) of this machine's collective
    stack, as the workers will find it: torch_npu's HCCL, NCCL where CUDA is, else gloo."""
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401 - what the workers import; registers torch.npu
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        except Exception as exc:  # noqa: BLE001 - said, and the ranks decide
            return "hccl", None, f"torch_npu (not importable here: {str(exc)[:120]})"
        return "hccl", ProcessGroupHCCL, "torch_npu"
    import torch

    if torch.cuda.is_available():
        return "nccl", getattr(torch.distributed, "ProcessGroupNCCL", None), "CUDA"
    return "gloo", None, "no GPU or NPU here"


def recovery_mode(env: Mapping[str, str]) -> Tuple[str, Optional[str]]:
    """What ttprun says at start about the recovery mode, and the TTP_RECOVERY its workers
    get (None: as set). In-memory recovery needs a stack that can abort a collective another
    thread waits in and build new groups after the abort (compat/features.recovery_support);
    where this one cannot, the dying checkpoint, and why (docs/stack.md has the table). Rank 0
    checks its real default group again when it starts the controller."""
    mode = config.value(env, config.ENV_RECOVERY)
    if mode != config.RECOVERY_MODES[0]:
        return f"recovery mode: dying checkpoint ({config.ENV_RECOVERY}={mode})", None
    from mindio_ttp.compat import features

    kind, backend, seen = _stack()
    if kind == "hccl" and backend is None:
        return (f"recovery mode: in memory if rank 0 finds the stack can ({seen}); else the "
                "dying checkpoint"), None
    ok, why = features.recovery_support(kind, backend)
    if ok:
        return f"recovery mode: in memory ({seen}: {why})", None
    return (f"recovery mode: dying checkpoint, not in memory ({seen}: {why}; docs/stack.md)",
            config.RECOVERY_MODES[1])


def refusal(problems: Sequence[str]) -> str:
    """The one message ttprun prints (after "ttprun: error: ") before it exits 2."""
    return (str(config.SettingsError(list(problems)))
            + "\nnothing was started; every setting: `ttprun --help` and docs/settings.md")


EXIT_CODES = (
    ("0", "every worker succeeded"),
    ("1", "a worker failed (also after a saved dying checkpoint, so a scheduler restarts the "
          "job); the last lines say what was saved and whether the same command resumes from "
          "it, --outcome-file PATH writes the same as JSON"),
    ("2", "bad setting, no key on a multi-node start, an unsafe key file, or a torch whose "
          "private names ttprun uses have drifted: nothing started"),
    ("128+N", "stopped by signal N (143: SIGTERM), after the survivors' grace period"),
)
RANK_CODES = {
    ExitCode.SAVED: "dying checkpoint saved",
    ExitCode.NO_CONSISTENT_STEP: "refused: no step with a clean copy of every shard",
    ExitCode.SAVE_FAILED: "save or rename failed, nothing marked latest",
    ExitCode.NO_VERDICT: f"no exit order within {config.ENV_OT}",
    ExitCode.NOT_CLAIMED: "another part of a split job claimed the fault",
}


def help_epilog() -> str:
    """TTP's settings and both kinds of exit codes, for the end of ``ttprun --help``."""
    lines = ["TTP settings (environment; checked before any worker starts):"]
    lines += config.help_lines()
    lines += ["", "ttprun exit codes:"]
    for code, what in EXIT_CODES:
        lines += textwrap.wrap(f"{code:<6} {what}", 96, initial_indent="  ",
                               subsequent_indent=" " * 9)
    lines += ["", "worker exit codes after a fault (named in ttprun's last lines):"]
    lines += [f"  {int(code):<6} {what}" for code, what in RANK_CODES.items()]
    lines += ["", "Symptoms, causes and fixes: docs/troubleshooting.md; every setting with "
              "its range: docs/settings.md."]
    return "\n".join(lines)
