"""Helper processes for tests and benches, forked from a clean server, never from the caller.

A test process is no clean parent. By the time a test forks, earlier tests have left threads,
held locks, C++ objects whose destructors join threads, and module state (a locked
`hooks.STATE`, a fence, a logger's closed stream) in it, and a fork copies all of it into
the child. In the full suite that showed as children that died at start ("terminate called
after throwing an instance of 'std::system_error': Invalid argument", CI of d78da3c,
test_tiers_scale) and forked demo ranks that registered but never trained (the two
outside-store jobs of test_control_plane_attacks, CI of c3de6d3), each passing alone.

multiprocessing's forkserver forks every child from a server process started fresh, with
torch and the runtime imported once (so a child still starts in a fraction of a second), and
no thread or test state in it. What a child runs and gets must therefore pickle: a
module-level function, plain data, pipes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import signal
from typing import Any, Callable, Optional

# imported once in the server, so each child starts without paying for them
PRELOAD = ["torch", "torch.distributed", "mindio_ttp.framework_ttp",
           "mindio_ttp.control.rank.processor", "mindio_ttp.control.agent.node"]


def clean_context() -> Any:
    """The multiprocessing context to start helper processes with (see the module's doc)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def helper_setup(cpus: Optional[set]) -> None:
    """What every helper process does first: Ctrl-C is the test's (it ends us through our
    pipe), the CPUs we are pinned to, and every file descriptor the hard limit allows."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def answer(pipe: Any, command: Callable[[str, Any], Any]) -> bool:
    """Serve one command from the parent's pipe; False once told to stop (or the parent is
    gone). An exception goes back to the parent, which raises it."""
    try:
        cmd, arg = pipe.recv()
    except EOFError:
        return False
    if cmd == "stop":
        pipe.send(True)
        return False
    try:
        pipe.send(command(cmd, arg))
    except Exception as exc:  # noqa: BLE001 - the parent sees it
        pipe.send(exc)
    return True


class Helper:
    """One helper process and its pipe: started from the clean server, its first message (what
    it is ready with) awaited, asked, and closed, also when a test fails."""

    def __init__(self, target: Callable[..., None], args: tuple, what: str,
                 start_timeout: float) -> None:
        ctx = clean_context()
        self.what = what
        self._pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=target, daemon=True, args=(theirs, *args))
        self.proc.start()
        theirs.close()
        if not self._pipe.poll(start_timeout):
            self.close()
            raise TimeoutError(f"{what} did not start within {start_timeout:g} s")
        try:
            self.first: Any = self._pipe.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"{what} ended (exit code {self.proc.exitcode}) before it was "
                               "ready: its stderr says why") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, cmd: str, timeout: float) -> Any:
        self._pipe.send(cmd)
        if not self._pipe.poll(timeout):
            raise TimeoutError(f"{self.what}: no answer to {cmd!r} within {timeout:g} s")
        return self._pipe.recv()

    def close(self, grace: float = 5.0) -> None:
        try:
            self._pipe.send("stop")
            self._pipe.poll(grace)
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
