"""flow-finished.json names the saved checkpoint, its schema is checked when read, and ttprun's
outcome lines say where the checkpoint is.

The files come from real flows: the in-process one of test_processor.py (a real Processor and
Controller over sockets, scripted peers) and, in the slow test, a real 4-rank demo job under
ttprun with a SIGKILL.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindio_ttp import framework_ttp as ttp
from mindio_ttp.config import FLOW_FINISHED_FILE, Outcome
from mindio_ttp.demo.checkpoint import step_dir_name
from mindio_ttp.demo.faults import Fault, FaultPlan, Phase
from mindio_ttp.demo.runner import launch
from mindio_ttp.launch.flow_record import FlowRecord, FlowRecordError, read_flow_record
from mindio_ttp.launch.outcome import CheckpointArgs, Ending, closing_lines, read_flow

from .test_processor import job, train_to  # noqa: F401  (the in-process flow fixture)


class Renamer:
    """A rename handler that knows where it puts the checkpoint (like megatron_ttp's)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list = []

    def __call__(self, step: int, ckpt_args: tuple) -> None:
        self.calls.append(step)
        (self.root / f"iter_{step:07d}").mkdir(parents=True)

    def checkpoint_location(self, step: int) -> str:
        return str(self.root / f"iter_{step:07d}")


def _killed(rank: int = 1) -> dict:
    return {rank: SimpleNamespace(exitcode=-int(signal.SIGKILL), timestamp=time.time())}


def outcome_lines(flow, failures, unreadable=None, ckpt=None) -> list:
    """ttprun's closing lines after a worker failure (exit 1)."""
    return closing_lines(Ending(1, failures, flow, unreadable), ckpt or CheckpointArgs())


def _saved_flow(job, tmp_path: Path, rename) -> Path:  # noqa: F811
    train_to(3)
    ctl, proc, codes, fakes = job(save=lambda step, ranks, args: None, rename=rename)
    fakes[1].close()
    assert proc.exited.wait(10), ctl.faults
    assert codes == [83]
    return tmp_path / "run" / FLOW_FINISHED_FILE


def test_saved_flow_names_the_checkpoint_and_ttprun_says_where(job, tmp_path):  # noqa: F811
    renamer = Renamer(tmp_path / "ckpt")
    path = _saved_flow(job, tmp_path, renamer)
    assert renamer.calls == [3]
    record = read_flow_record(path)
    assert record.outcome is Outcome.SAVED and record.step == 3
    assert record.checkpoint == str(tmp_path / "ckpt" / "iter_0000003")
    flow, unreadable = read_flow(path)
    assert unreadable is None
    lines = outcome_lines(flow, _killed(1))
    assert lines[0].startswith("rank 1 (node ") and "was killed by SIGKILL" in lines[0]
    assert lines[1] == (f"dying checkpoint of iteration 3 saved in {tmp_path / 'ckpt'}"
                        "/iter_0000003 and marked latest (exit 83 on the ranks that took part, "
                        "not failures)")
    assert lines[2].startswith("exit 1 so your scheduler restarts the job")


@pytest.mark.parametrize("args, said", [
    (["--save", "/c", "--load", "/c"], "the same command resumes from iteration 3 (--load /c)"),
    (["--save=/c", "--load=/c/"], "the same command resumes from iteration 3 (--load /c/)"),
    (["--save", "/c"], "the same command does NOT resume: it has no --load; add --load /c to "
                       "resume from iteration 3"),
    (["--save", "/c", "--load", "/old"], "the same command does NOT resume from it: its --load "
                                         "is /old, not --save /c; give --load /c"),
    (["--steps", "9"], "resume from iteration 3 (/c/iter_0000003) if your script loads it"),
])  # fmt: skip
def test_resume_is_promised_only_when_the_command_loads_what_it_saved(args, said) -> None:
    """Before: "run the same command to resume" also without --load, which restarted from
    iteration 1 (and a rerun's dying checkpoint then replaced the good one as latest)."""
    flow = FlowRecord(Outcome.SAVED, 3, (0, 3), 83, "", 0, time.time(), "/c/iter_0000003", 3)
    lines = outcome_lines(flow, _killed(1), ckpt=CheckpointArgs.parse(args))
    assert lines[2].startswith("exit 1 so your scheduler restarts the job; "), lines
    assert said in lines[2], lines
    assert ("does NOT" in lines[2]) == (not CheckpointArgs.parse(args).resumes
                                        and "--save" in " ".join(args))


def test_a_checkpoint_older_than_latest_is_said_not_latest_and_the_rerun_loads_the_newer():
    flow = FlowRecord(Outcome.SAVED, 209, (0, 3), 83, "", 0, time.time(), "/c/iter_0000209", 605)
    lines = outcome_lines(flow, _killed(1), ckpt=CheckpointArgs.parse(["--save", "/c",
                                                                       "--load", "/c"]))
    assert lines[1].startswith("dying checkpoint of iteration 209 saved in /c/iter_0000209, "
                               "NOT marked latest: latest names iteration 605, which is newer "
                               "(both are kept)"), lines
    assert lines[2].endswith("the same command resumes from iteration 605 (--load /c)"), lines


@pytest.mark.parametrize("flag", [(), ("--save", "/c", "--load", "/c")])
def test_every_ending_gets_three_closing_lines(flag) -> None:
    """A preemption ended with the flow's raw JSON, a kill with plain lines: now every
    ending says what happened, what the runtime did, the exit code and what next."""
    ckpt = CheckpointArgs.parse(flag)
    saved = FlowRecord(Outcome.SAVED, 7, (0, 1, 2, 3), 83, "", 0, time.time(), "/c/iter_0000007")
    endings = [
        Ending(143, {}, saved, signal="SIGTERM"),
        Ending(1, _killed(1), saved),
        Ending(1, _killed(2)),
        Ending(0),
        Ending(0, recoveries=[{"recovery_id": 1, "iteration": 4, "replaced": [1]}]),
    ]
    for ending in endings:
        lines = closing_lines(ending, ckpt)
        assert len(lines) == (4 if ending.recoveries and ending.flow else 3), lines
        assert lines[-1].startswith(f"exit {ending.exit_code}"), lines
        assert not any(line.lstrip().startswith("{") for line in lines), lines
    pre = closing_lines(endings[0], ckpt)
    assert pre[0] == "ttprun got SIGTERM (preemption)" and "iteration 7" in pre[1], pre
    assert pre[2].startswith("exit 143 (SIGTERM); "), pre
    assert closing_lines(endings[4], ckpt)[1].startswith("recovered in memory 1 time(s), no "
                                                         "iteration lost")
    for ending in endings:  # one word for the number
        assert not any(" step " in line for line in closing_lines(ending, ckpt))


def test_rename_handler_without_a_locator_gives_the_line_without_a_place(job, tmp_path):  # noqa: F811
    path = _saved_flow(job, tmp_path, lambda step, args: None)
    record = read_flow_record(path)
    assert record.checkpoint is None
    assert outcome_lines(record, _killed(1))[1].startswith(
        "dying checkpoint of iteration 3 saved and marked latest (exit 83")


def test_a_failing_locator_does_not_stop_the_exit(job, tmp_path, caplog):  # noqa: F811
    renamer = Renamer(tmp_path / "ckpt")
    renamer.checkpoint_location = lambda step: 1 / 0  # type: ignore[method-assign]
    path = _saved_flow(job, tmp_path, renamer)
    assert read_flow_record(path).checkpoint is None
    assert "checkpoint_location(3) failed: division by zero" in caplog.text


def test_register_refuses_a_locator_that_cannot_take_a_step() -> None:
    def rename(step, ckpt_args):
        pass

    rename.checkpoint_location = "/ckpt"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="checkpoint_location needs a callable"):
        ttp.ttp_register_rename_handler(rename)
    rename.checkpoint_location = lambda: "/ckpt"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"cannot be called as checkpoint_location\(step\)"):
        ttp.ttp_register_rename_handler(rename)


@pytest.fixture
def real_record(job, tmp_path) -> dict:  # noqa: F811
    """The dict a real saved flow wrote, to damage one field at a time."""
    path = _saved_flow(job, tmp_path, Renamer(tmp_path / "ckpt"))
    return json.loads(path.read_text())


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(outcome="done"), "outcome 'done' is not one of"),
    (lambda r: r.update(step=None), "outcome is saved but step is null"),
    (lambda r: r.update(step=-1), "step -1 is not null or a count"),
    (lambda r: r.update(step=True), "step True is not null or a count"),
    (lambda r: r.update(ranks=[0, "3"]), "ranks [0, '3'] is not a list of ranks"),
    (lambda r: r.update(exit_code="83"), "exit_code '83' is not a count"),
    (lambda r: r.update(reason=None), "reason None is not a string"),
    (lambda r: r.update(time=float("nan")), "time nan is not a number"),
    (lambda r: r.update(checkpoint="/ckpt\n\x1b[2Jiter_3"), "is not a printable path"),
    (lambda r: r.update(checkpoint=""), "is not a printable path"),
    (lambda r: r.update(latest="9"), "latest '9' is not null or a count"),
    (lambda r: r.pop("reason"), "has keys"),
    (lambda r: r.update(extra=1), "has keys"),
])  # fmt: skip
def test_damaged_record_is_refused_naming_the_field(real_record, tmp_path, change, message):
    change(real_record)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(real_record))
    with pytest.raises(FlowRecordError) as err:
        read_flow_record(path)
    assert message in str(err.value)
    flow, unreadable = read_flow(path)
    assert flow is None and message in unreadable
    lines = outcome_lines(flow, _killed(2), unreadable)
    assert lines[1].startswith("the dying-checkpoint flow left an unusable record (")
    assert "no dying-checkpoint flow ran" not in "\n".join(lines)


@pytest.mark.parametrize("content, message", [
    (b"[]", "holds a JSON list, not an object"),
    (b"{not json", "is not JSON"),
    (b"\xff\xfe", "is not JSON"),
    (b" " * (64 * 1024 + 1), "is larger than 65536 bytes"),
])  # fmt: skip
def test_garbage_file_is_refused(tmp_path, content, message):
    path = tmp_path / FLOW_FINISHED_FILE
    path.write_bytes(content)
    with pytest.raises(FlowRecordError, match=message):
        read_flow_record(path)


def test_no_file_means_no_flow_ran(tmp_path):
    assert read_flow(tmp_path / FLOW_FINISHED_FILE) == (None, None)
    lines = outcome_lines(None, _killed(0))
    assert lines[1].startswith("no dying-checkpoint flow ran, nothing was saved")
    assert lines[2] == "exit 1"


def test_record_from_before_the_checkpoint_field_still_reads(real_record):
    del real_record["checkpoint"], real_record["latest"]
    record = FlowRecord.from_dict(real_record)
    assert record.checkpoint is None and record.step == 3 and record.marked_latest
    assert record.to_dict() == dict(real_record, checkpoint=None, latest=None)


@pytest.mark.slow
def test_ttprun_names_the_demo_jobs_dying_checkpoint(tmp_path: Path) -> None:
    """A real flow: 4 ranks under ttprun, rank 1 SIGKILLed inside the update window of step 3."""
    result = launch(tmp_path, 4, FaultPlan().fail_at(1, 3, Fault.SIGKILL, Phase.INSIDE))
    assert result.returncode == 1, result.output
    [path] = sorted(result.run_dir.glob(f"*/{FLOW_FINISHED_FILE}"))
    record = read_flow_record(path)
    where = (result.ckpt_dir / step_dir_name(3)).absolute()
    assert record.checkpoint == str(where) and (where / "manifest.json").is_file()
    said = (f"ttprun: dying checkpoint of iteration 3 saved in {where} and marked latest "
            "(exit 83 on the ranks that took part, not failures)")
    assert said in result.lines, result.output
    assert outcome_lines(record, _killed(1))[1] == said[len("ttprun: "):]
