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
from typing import Any

# imported once in the server, so each child starts without paying for them
PRELOAD = ["torch", "torch.distributed", "mindio_ttp.framework_ttp",
           "mindio_ttp.control.processor", "mindio_ttp.control.agent.node"]


def clean_context() -> Any:
    """The multiprocessing context to start helper processes with (see the module's doc)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
