"""`ttp-patch`: parse arguments, call one operation, print, return the exit code.

stdout carries only the payload (diffs, the status table or JSON) so it can be redirected;
messages and errors go to stderr; with `status/verify --json` an error is also printed on
stdout as a JSON object ({"overall": "error", "error": {"type", "message", "hint",
"exit_code"}}), with the same exit code, so a pipeline always has a document to parse.
Exit codes: 0 done / nothing to do / verified, 1 the tree is not in the state the command
needs (verify failed, drift, modified files, anchors not found), 2 usage or environment
errors (not a git repo, wrong commit, unreadable or read-only files, corrupt record, failed
write), 128+N interrupted by signal N.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any, Dict, Optional, Sequence

from . import __version__, fileio
from .apply import apply, diff
from .errors import EXIT_ENVIRONMENT, EXIT_OK, Interrupted, PatchError, UsageError
from .options import DEFAULT_PORT, PORT_RANGE, Device, Options, adaptor_warning
from .revert import revert
from .status import status


class _ArgumentError(SystemExit):
    """argparse's exit, with its message kept for the JSON error of `verify --json`."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_ENVIRONMENT)
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep our prefix and hint
        self.print_usage(sys.stderr)
        sys.stderr.write(f"ttp-patch: error: {message}\n")
        raise _ArgumentError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ttp-patch",
        description="Insert the MindIO TTP guide's edits into Megatron-LM 285068c (and take "
        "them out again), byte-exact and all-or-nothing.",
        epilog="exit codes: 0 ok, 1 not applied / drifted / refused by content, "
        "2 usage or environment error",
    )
    p.add_argument("--version", action="version", version=f"ttp-patch {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    devices = [d.value for d in Device]

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument(
            "dir",
            nargs="?",
            default=".",
            metavar="DIR",
            help="the Megatron-LM checkout (default: .)",
        )
        return sp

    sp = add("apply", "apply the guide's 14 edits and ttp-patch's 7, write the script")
    sp.add_argument(
        "--device",
        choices=devices,
        default="npu",
        help="adaptor import in pretrain_gpt.py and the launch script's flags: npu (the "
        "default, as in the guide: import megatron_npu, Ascend's adaptor), cuda (NVIDIA GPUs, "
        "no import), cpu (a CPU rehearsal: mindio_ttp.cpu_adaptor)",
    )
    sp.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="TTP controller port written into the start-up block and the launch script "
        f"({PORT_RANGE[0]}..{PORT_RANGE[1]}, not the example's MASTER_PORT; default "
        f"{DEFAULT_PORT})",
    )
    sp.add_argument("--dry-run", action="store_true", help="print the diff, change nothing")
    sp.add_argument(
        "--allow-modified",
        action="store_true",
        help="also patch target files that differ from 285068c's (a fork, a later commit, "
        "your edits) when every edit's anchor is found exactly once; revert gives your bytes back",
    )

    sp = add("revert", "restore your pre-apply bytes of every patched file (HEAD's, or your own "
             "edits that apply kept a copy of), remove the script and the record; later "
             "edits of yours outside ours are kept")
    sp.add_argument(
        "--force",
        action="store_true",
        help="also when files changed after apply (those changes are lost)",
    )

    for name, help_ in (
        ("status", "show the state of every edit"),
        ("verify", "CI gate: exit 0 only when every edit is applied"),
    ):
        sp = add(name, help_)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.add_argument(
            "--device",
            choices=devices,
            default=None,
            help="the device to expect (default: recorded by apply, else read "
            "from pretrain_gpt.py)",
        )

    sp = add("diff", "print the diff apply makes (or made)")
    sp.add_argument("--device", choices=devices, default="npu")
    sp.add_argument("--port", type=int, default=DEFAULT_PORT)
    return p


def next_steps(directory: str, opts: Options) -> list:
    """What a user does after apply, in order (stderr: stdout carries only payloads)."""
    script = f"{directory.rstrip('/')}/pretrain_gpt_ttp.sh"
    fill = "DATA_PATH, VOCAB_FILE, MERGE_FILE, CHECKPOINT_PATH"
    if opts.device is Device.NPU:
        fill = "ENV_NPU_SH, " + fill
    steps = [
        "next steps:",
        f"  1. fill in the '>>> FILL IN' lines of {script} ({fill}), or export them;",
        "     several nodes: also MASTER_ADDR, NNODES, NODE_RANK and the same TTP_AUTH_KEY on "
        "every node",
        f"  2. run `bash {script}` on every node (it says at once what is still missing)",
    ]
    if opts.device is Device.CPU:
        steps.append(f"     or rehearse a fault first: ttp-demo --megatron {directory}")
    steps.append(f"  then: `ttp-patch verify {directory}` checks the edits, `ttp-patch revert "
                 f"{directory}` takes them out; every setting: `ttprun --help`")
    return steps


def _say(message: str) -> None:
    print(f"ttp-patch: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.command == "apply":
        opts = Options.build(args.device, args.port)
        out = apply(args.dir, opts, dry_run=args.dry_run, allow_modified=args.allow_modified)
        for note in out.notes:
            _say(note)
        if args.dry_run:
            sys.stdout.write(out.diff)
            _say("dry run: nothing written" + ("" if out.written else "; nothing to do"))
        elif out.noop:
            _say(f"already applied ({opts.describe()}): nothing to do")
        else:
            _say(f"applied ({opts.describe()}); wrote " + ", ".join(out.written))
            for line in next_steps(args.dir, opts):
                _say(line)
        warning = adaptor_warning(opts.device)
        if warning:
            _say(warning)
        return EXIT_OK
    if args.command == "revert":
        res = revert(args.dir, force=args.force)
        if res.nothing_to_do:
            _say("nothing to revert: the tree has no ttp-patch edits")
        else:
            done = res.restored + [f"removed {p}" for p in res.removed]
            _say("reverted: " + (", ".join(done) or "only the record"))
        if res.drifted_forced:
            _say("--force discarded changes in: " + ", ".join(res.drifted_forced))
        for path in res.kept:
            _say(f"left {path} alone: it was not written by ttp-patch")
        for path in res.merged:
            _say(f"kept your later changes in {path}: took out only ttp-patch's edits")
        return EXIT_OK
    if args.command in ("status", "verify"):
        report = status(args.dir, device=args.device)
        sys.stdout.write(report.to_json() + "\n" if args.json else report.to_text())
        return (report.verify_exit_code if args.command == "verify"
                else report.status_exit_code)
    if args.command == "diff":
        sys.stdout.write(diff(args.dir, Options.build(args.device, args.port)))
        return EXIT_OK
    raise AssertionError(args.command)  # pragma: no cover - argparse restricts commands


def _outside_write_phase(signum: int) -> Interrupted:
    """A signal outside the write phase (which defers them): before it nothing was written,
    after it the command had completed."""
    name = signal.Signals(signum).name
    if fileio.committed():
        return Interrupted(signum, f"interrupted by {name} after the files were written: "
                                   "the command completed")
    return Interrupted(signum, f"interrupted by {name} before anything was written")


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _outside_write_phase(signum)


def _log_to_stderr() -> logging.Handler:
    """Recovery of an interrupted run reports through logging; the user sees it on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ttp-patch: %(message)s"))
    log = logging.getLogger("ttp_patch")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return handler


def _wants_json(argv: Sequence[str]) -> bool:
    """`status`/`verify` with --json, read from the words when argparse could not parse them."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in ("status", "verify") and "--json" in argv


def _json_error(error: Dict[str, Any], directory: Optional[str]) -> None:
    doc = {"schema": 1, "directory": directory, "overall": "error", "error": error}
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def _refused(exc: PatchError, as_json: bool, directory: Optional[str]) -> int:
    print(exc.render(), file=sys.stderr)
    if as_json:
        _json_error(exc.as_dict(), directory)
    return exc.exit_code


def main(argv: Optional[Sequence[str]] = None) -> int:
    words = list(argv) if argv is not None else sys.argv[1:]
    try:
        args = _parser().parse_args(words)
    except _ArgumentError as exc:
        if _wants_json(words):
            _json_error(UsageError(exc.message, "see `ttp-patch verify --help`").as_dict(), None)
        raise
    as_json = bool(getattr(args, "json", False))
    fileio.reset_committed()
    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    handler = _log_to_stderr()
    try:
        return _run(args)
    except KeyboardInterrupt:  # outside the write phase (it defers signals): nothing written
        exc = _outside_write_phase(signal.SIGINT)
        return _refused(exc, as_json, args.dir)
    except PatchError as exc:
        return _refused(exc, as_json, args.dir)
    except Exception as exc:  # a bug: the traceback and exit 1 as before, but JSON first
        if as_json:
            _json_error({"type": "InternalError", "message": f"{type(exc).__name__}: {exc}",
                         "hint": "a bug in ttp-patch: please report the traceback on stderr",
                         "exit_code": 1}, args.dir)
        raise
    finally:
        logging.getLogger("ttp_patch").removeHandler(handler)
        if in_main:
            signal.signal(signal.SIGTERM, old_term)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
