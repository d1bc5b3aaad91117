"""How a launch ended, in the same plain lines for every ending, and as one JSON record.

Every ending gets three closing lines from ttprun (what happened, what the runtime did, what
exit code and what next): a worker lost and a dying checkpoint saved or refused, a crash with
nothing saved, a preemption (SIGTERM), a run that went through in-memory recoveries, a clean
run. The same facts go to ``--outcome-file PATH`` as JSON, so a wrapper never parses logs.

"What next" depends on the training command: the dying checkpoint goes to Megatron's
``--save``, and only ``--load`` naming the same directory resumes from it. ttprun reads both
from the training script's arguments (`CheckpointArgs`) and never says "the same command
resumes" when it cannot.

The number is Megatron's "iteration" everywhere (the runtime's "step" is the same count).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from mindio_ttp.config import Outcome
from mindio_ttp.launch.flow_record import FlowRecord, FlowRecordError, read_flow_record

SCHEMA = 1
# in TTP_RUN_DIR: one record per in-memory recovery a rank of this node saw committed
RECOVERED_DIR = "recovered"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's (faulttime/manifest.py)

_OUTCOME_WORDS = {
    Outcome.SAVED: "dying checkpoint of iteration {step} saved{where} and marked latest",
    Outcome.NO_CONSISTENT_STEP: "no iteration had a clean copy of every shard, so nothing was "
    "saved (the last regular checkpoint stays latest)",
    Outcome.SAVE_FAILED: "the dying-checkpoint save failed ({reason}); nothing new was marked "
    "latest",
    Outcome.NO_VERDICT: "no save decision was reached ({reason}); nothing new was marked latest",
    Outcome.NOT_CLAIMED: "this part of the job saved nothing ({reason}); at most one part of a "
    "split job saves a fault's checkpoint",
}
# the record's names for the flow's outcomes (the exit codes' table: docs/troubleshooting.md)
_RECORD_NAMES = {
    Outcome.SAVED: "saved", Outcome.NO_CONSISTENT_STEP: "refused",
    Outcome.SAVE_FAILED: "save_failed", Outcome.NO_VERDICT: "no_verdict",
    Outcome.NOT_CLAIMED: "not_claimed",
}


# -- the training command's checkpoint arguments ------------------------------------------------
def _option(args: Sequence[str], name: str) -> Optional[str]:
    """The last value of `name` in `args` (``--name V`` or ``--name=V``), as argparse takes it."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1:]
    return found


@dataclass(frozen=True)
class CheckpointArgs:
    """Megatron's ``--save`` and ``--load`` in the training command (None: absent)."""

    save: Optional[str] = None
    load: Optional[str] = None

    @classmethod
    def parse(cls, script_args: Sequence[str]) -> CheckpointArgs:
        args = [str(a) for a in script_args]
        return cls(_option(args, "--save"), _option(args, "--load"))

    @property
    def megatron(self) -> bool:
        """The command names Megatron's checkpoint directories (else ttprun cannot tell how
        the script resumes)."""
        return self.save is not None or self.load is not None

    @property
    def resumes(self) -> bool:
        """The same command loads what this run saves."""
        return (self.save is not None and self.load is not None
                and _same_dir(self.save, self.load))

    def start_warnings(self) -> List[str]:
        """Said before any worker starts: a run that will lose its progress in silence."""
        if self.save is not None and self.load is None:
            return [f"--save {self.save} without --load: this run starts from iteration 0 "
                    "whatever that directory holds, a rerun of this command cannot resume from "
                    "its checkpoints (the dying checkpoint included), and in-memory recovery is "
                    f"off (it refills through the loader --load enables): add --load {self.save}"]
        if self.save is not None and self.load is not None and not self.resumes:
            return [f"--load {self.load} is not --save {self.save}: the dying checkpoint goes "
                    "to --save, and a rerun of this command loads from --load, so it does not "
                    f"resume from the dying checkpoint (give --load {self.save} to do so)"]
        return []

    def next_step(self, iteration: Optional[int], where: Optional[str]) -> str:
        """What a rerun of this command does with the checkpoint of `iteration` in `where`."""
        if iteration is None:
            return "the same command starts from the checkpoint latest names, if any"
        if not self.megatron:
            return (f"resume from iteration {iteration} ({where or 'the checkpoint directory'})"
                    " if your script loads it; ttprun cannot tell from its arguments")
        if self.load is None:
            return (f"the same command does NOT resume: it has no --load; add --load "
                    f"{self.save} to resume from iteration {iteration}")
        if not self.resumes:
            return (f"the same command does NOT resume from it: its --load is {self.load}, not "
                    f"--save {self.save}; give --load {self.save} to resume from iteration "
                    f"{iteration}")
        return f"the same command resumes from iteration {iteration} (--load {self.load})"

    def latest(self) -> Optional[int]:
        """The iteration Megatron's tracker in --save names (None: none, or unreadable)."""
        if self.save is None:
            return None
        try:
            text = (Path(self.save) / TRACKER).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return int(text) if text.isdigit() else None


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


# -- what the run left behind -------------------------------------------------------------------
def read_flow(path: Path) -> Tuple[Optional[FlowRecord], Optional[str]]:
    """``(record, None)``; ``(None, None)`` when no flow finished (no file); ``(None, why)``
    when the file is there but unusable, so the outcome lines say so instead of "no flow"."""
    try:
        return read_flow_record(path), None
    except FileNotFoundError:
        return None, None
    except (OSError, FlowRecordError) as exc:
        return None, f"{path} {exc}" if isinstance(exc, FlowRecordError) else str(exc)


def write_recovered(run_dir: Optional[str], recovery_id: int, iteration: int,
                    lost: Sequence[int]) -> None:
    """A rank saw recovery `recovery_id` committed (every rank ready, every copy's hash check
    passed): tell its launcher. Never raises (the processor's thread calls it)."""
    if not run_dir:
        return
    try:
        folder = Path(run_dir) / RECOVERED_DIR
        folder.mkdir(exist_ok=True)
        record = {"recovery_id": int(recovery_id), "iteration": int(iteration),
                  "replaced": sorted(int(r) for r in lost), "time": time.time()}
        tmp = folder / f".r{recovery_id}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, folder / f"r{recovery_id}.json")
    except (OSError, ValueError, TypeError):
        pass


def read_recovered(run_dir: Path) -> List[Dict[str, Any]]:
    """The committed in-memory recoveries this node's workers recorded, in order."""
    out = []
    for path in sorted((Path(run_dir) / RECOVERED_DIR).glob("r*.json")):
        try:
            obj = json.loads(path.read_text(encoding="utf-8")[:4096])
            out.append({"recovery_id": int(obj["recovery_id"]),
                        "iteration": int(obj["iteration"]),
                        "replaced": [int(r) for r in obj["replaced"]][:64]})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: r["recovery_id"])


# -- the ending ---------------------------------------------------------------------------------
@dataclass
class Ending:
    """How the launch ended: `exit_code` ttprun returns; `failures` torch's {rank: failure}
    (exitcode, timestamp); `signal` the signal that stopped ttprun (SIGTERM: a preemption)."""

    exit_code: int
    failures: Mapping[int, Any] = field(default_factory=dict)
    flow: Optional[FlowRecord] = None
    unreadable: Optional[str] = None
    signal: Optional[str] = None
    recoveries: List[Dict[str, Any]] = field(default_factory=list)
    node: str = field(default_factory=socket.gethostname)

    def failed_ranks(self) -> Dict[int, Any]:
        """Ranks that failed, without those that exited with the flow's own code: they did so
        *because* of the fault (e.g. 83 after saving), so they are not failures."""
        consequence = None if self.flow is None else self.flow.exit_code
        return {r: f for r, f in self.failures.items() if f.exitcode != consequence}

    @property
    def name(self) -> str:
        if self.flow is not None:
            return _RECORD_NAMES.get(self.flow.outcome, self.flow.outcome.value)
        if self.unreadable:
            return "unusable_record"
        if self.exit_code == 0:
            return "recovered" if self.recoveries else "succeeded"
        return "nothing_saved"


def closing_lines(ending: Ending, ckpt: CheckpointArgs = CheckpointArgs()) -> List[str]:
    """The last lines of every launch: what happened, what the runtime did, exit code and
    what next. Same shape for a kill, a crash, a preemption and a clean run."""
    what = []
    for rank, failure in sorted(ending.failed_ranks().items()):
        when = time.strftime("%H:%M:%S", time.localtime(failure.timestamp))
        how = (f"was killed by {signal.Signals(-failure.exitcode).name}"
               if failure.exitcode < 0 else f"exited with code {failure.exitcode}")
        what.append(f"rank {rank} (node {ending.node}) {how} at {when}")
    if ending.signal is not None:
        why = " (preemption)" if ending.signal == "SIGTERM" else ""
        what.insert(0, f"ttprun got {ending.signal}{why}")
    if not what:
        what.append("every worker succeeded" if ending.exit_code == 0 else
                    "no worker of this node failed: the fault was on another node (its ttprun "
                    "names the rank)" if ending.flow is not None else "the job was stopped")
    lines = ["; ".join(what)]
    recovered = [f"recovery {r['recovery_id']} at iteration {r['iteration']} replaced rank(s) "
                 f"{r['replaced']}" for r in ending.recoveries]
    if recovered:
        lines.append(f"recovered in memory {len(recovered)} time(s), no iteration lost, every "
                     f"copy's hash check passed: {'; '.join(recovered)}")
    flow = ending.flow
    code = ending.exit_code
    if flow is not None:
        lines.append(_flow_line(flow))
        after = _after_flow(flow, ckpt)
        if ending.signal is None:
            lines.append(f"exit {code} so your scheduler restarts the job; {after}")
        else:
            lines.append(f"exit {code} ({ending.signal}); {after}")
    elif ending.unreadable:
        lines.append(f"the dying-checkpoint flow left an unusable record ({ending.unreadable});"
                     " see the workers' log lines for what was saved")
        lines.append(f"exit {code}")
    elif code == 0:
        if not recovered:
            lines.append("no fault")
        lines.append("exit 0")
    else:
        lines.append("no dying-checkpoint flow ran, nothing was saved" + (
            "" if ending.signal else " (a failure before the runtime started, or one it "
                                     "could not see)"))
        lines.append(f"exit {code}; {ckpt.next_step(ckpt.latest(), ckpt.save)}"
                     if ckpt.latest() is not None else f"exit {code}")
    return lines


def _flow_line(flow: FlowRecord) -> str:
    where = f" in {flow.checkpoint}" if flow.checkpoint else ""
    words = _OUTCOME_WORDS.get(flow.outcome, "flow outcome {outcome}: {reason}")
    text = words.format(step=flow.step, reason=flow.reason, outcome=flow.outcome.value,
                        where=where)
    if flow.outcome is Outcome.SAVED and not flow.marked_latest:
        text = (f"dying checkpoint of iteration {flow.step} saved{where}, NOT marked latest: "
                f"latest names iteration {flow.latest}, which is newer (both are kept)")
    return text + f" (exit {flow.exit_code} on the ranks that took part, not failures)"


def _after_flow(flow: FlowRecord, ckpt: CheckpointArgs) -> str:
    if flow.outcome is Outcome.SAVED:
        if flow.marked_latest:
            return ckpt.next_step(flow.step, flow.checkpoint)
        return ckpt.next_step(flow.latest, None)
    latest = ckpt.latest()
    if latest is None:
        return ("nothing new to resume from" if ckpt.megatron else
                "rerunning resumes from the last checkpoint your script loads")
    return ckpt.next_step(latest, ckpt.save)


def record(ending: Ending, ckpt: CheckpointArgs, lines: Sequence[str],
           drill: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``--outcome-file`` document (schema in docs/troubleshooting.md)."""
    flow = ending.flow
    saved = flow is not None and flow.outcome is Outcome.SAVED
    return {
        "schema": SCHEMA,
        "outcome": ending.name,
        "exit_code": ending.exit_code,
        "signal": ending.signal,
        "preempted": ending.signal == "SIGTERM",
        "iteration": flow.step if flow is not None else None,
        "checkpoint": flow.checkpoint if saved else None,
        "marked_latest": flow.marked_latest if saved else None,
        "latest": (flow.latest if flow is not None and flow.latest is not None
                   else ckpt.latest()),
        "resumes": ckpt.resumes if ckpt.megatron else None,
        "failed_ranks": sorted(ending.failed_ranks()),
        "recoveries": ending.recoveries,
        "reason": flow.reason if flow is not None else (ending.unreadable or ""),
        "drill": drill,
        "lines": list(lines),
    }


def write_outcome_file(path: str, doc: Dict[str, Any]) -> Optional[str]:
    """Atomically; the error text (said on stderr) or None."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return f"cannot write --outcome-file {path}: {exc}"
    return None


def describe_flow(flow: Optional[FlowRecord], unreadable: Optional[str]) -> str:
    """One line for "the flow finished": words, not the record's JSON."""
    if flow is None:
        return f"an unusable record ({unreadable})" if unreadable else "no record"
    return _flow_line(flow)
