"""A tiny data-parallel "training job" for the runtime's multi-process tests.

Each rank all-reduces a gradient (gloo), passes a barrier, brackets its parameter update with
the TTP hooks, and can inject one fault at (rank, step, phase). The save handler writes its
shard under <out>/iter_<step>_tmp/, the rename handler moves it to <out>/iter_<step> and
writes <out>/latest. Configured entirely by env so the tests can launch plain subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mindio_ttp.framework_ttp as ttp

RANK, WORLD, PLAN, OUT = 0, 1, {}, "."  # set by main() from the env
CONTROLLER_PID_FILE = "controller.pid"


def progress_file(rank: int) -> str:
    return os.path.join(OUT, "..", "progress", f"rank_{rank}")


def note_progress(step: int) -> None:
    """This rank's update of `step` is done (read by `wait_for_others`)."""
    path = progress_file(RANK)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(path + ".tmp", path)


def wait_for_others(step: int, limit: float = 20.0) -> None:
    """Until every other rank has done its update of `step` (they can: its collectives are
    behind them), so the fault cannot reach a survivor before that update: without this, a
    survivor the fault's news reaches first is held at its gate with step - 1, and that is the
    newest step it holds (test_survivors_held_at_the_gate_save_the_step_they_hold)."""
    deadline = time.monotonic() + limit
    for r in range(WORLD):
        while r != RANK and time.monotonic() < deadline:
            try:
                with open(progress_file(r)) as f:
                    if int(f.read() or 0) >= step:
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)


def inject(phase: str, step: int) -> None:
    for f in PLAN.get("faults", []):
        if f["rank"] == RANK and f["step"] == step and f["phase"] == phase:
            kind = f["kind"]
            if f.get("after_others"):
                wait_for_others(step)
            print(f"worker {RANK}: injecting {kind} at step {step} {phase}", flush=True)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind in ("kill_host", "stop_host"):  # node 0 lost: rank 0 and its controller
                sig = signal.SIGKILL if kind == "kill_host" else signal.SIGSTOP
                os.kill(ttp._controller.pid, sig)
                for r in f.get("with_ranks", []):  # lost with it, before anyone fails over
                    with open(progress_file(r) + ".pid") as pid:
                        os.kill(int(pid.read()), sig)
                os.kill(os.getpid(), sig)
            elif kind == "kill_agent":  # this node's agent process, found by its socket's peer
                import struct
                conn = ttp._processor._conn
                pid = struct.unpack("3i", conn.sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                print(f"worker {RANK}: killing the node agent (pid {pid})", flush=True)
                os.kill(pid, signal.SIGKILL)
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            elif kind == "garbage":  # an unauthenticated peer pokes the controller
                from mindio_ttp.control.wire import protocol as P
                port = int(os.environ["TTP_CONTROLLER_PORT"])
                for junk in (b"GET / HTTP/1.0\r\n\r\n", P.encode(P.Goodbye(0), b"k" * 32)):
                    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                        s.sendall(junk)
                        while s.recv(4096):  # its challenge, then the controller closes
                            pass
            elif kind == "until_locked":  # hold here until this rank's processor locks it
                from mindio_ttp.hooks import STATE
                deadline = time.monotonic() + 20
                while not STATE.locked and time.monotonic() < deadline:
                    time.sleep(0.01)
                print(f"worker {RANK}: locked={STATE.locked} before its update", flush=True)
            elif kind == "exception":
                raise RuntimeError(f"injected failure on rank {RANK} at step {step} {phase}")


def probe_listeners(path: str) -> None:
    """An outsider's view of this process during a save: for every TCP port it listens on, try
    what a torch TCPStore client can do there (list the keys, write one). Only TTP listeners
    (which answer with a challenge and close) may be found; the per-save TCPStore was another.
    A client that gets no sensible answer may retry for long: each probe has 5 s. The job's
    own rendezvous store is skipped (a forked rank inherits the test's listening socket)."""
    import threading

    import psutil

    found = {}

    def probe(ip: str, port: int) -> None:
        try:
            store = dist.TCPStore(ip, port, is_master=False, timeout=timedelta(seconds=2))
            keys = store.list_keys()
            store.set("outsider", "was here")
            found[port] = f"open: {len(keys)} key(s): {sorted(keys)[:8]}"
        except Exception as exc:  # noqa: BLE001 - what the outsider gets
            found[port] = f"refused: {type(exc).__name__}: {str(exc)[:200]}"
    threads = []
    job_store = int(os.environ["MASTER_PORT"])  # torch's rendezvous store: not ours to guard
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port != job_store:
            found[c.laddr.port] = "refused: no answer within 5 s"
            threads.append(threading.Thread(target=probe, args=(c.laddr.ip, c.laddr.port),
                                            daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    with open(path, "w") as f:
        json.dump(found, f)


def save(step: int, save_ranks: list, args: tuple) -> None:
    if PLAN.get("probe_listeners_rank") == RANK:
        probe_listeners(os.path.join(OUT, f"probe-{RANK}.json"))
    failing = PLAN.get("save_fail_rank")
    if RANK in (failing if isinstance(failing, list) else [failing]):
        raise OSError("injected: disk full")
    if PLAN.get("save_kill_rank") == RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    if PLAN.get("save_kill_host") == RANK:
        os.kill(ttp._controller.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if PLAN.get("save_hang_rank") == RANK:
        time.sleep(3600)
    _, param = args
    tmp = os.path.join(OUT, f"iter_{step}_tmp")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, f"rank_{RANK}.json"), "w") as f:
        json.dump({"step": step, "save_ranks": save_ranks, "param": param.tolist()}, f)


def rename(step: int, args: tuple) -> None:
    os.replace(os.path.join(OUT, f"iter_{step}_tmp"), os.path.join(OUT, f"iter_{step}"))
    with open(os.path.join(OUT, "latest"), "w") as f:
        f.write(str(step))


@ttp.ttp_to_persist
def train(param: torch.Tensor, steps: int) -> None:
    for step in range(1, steps + 1):
        grad = torch.full((4,), float(step))
        dist.all_reduce(grad)  # every collective stays outside the update window
        dist.barrier()
        inject("before", step)
        ttp.ttp_start_updating_os(-1)
        inject("inside", step)
        param += grad
        ttp.ttp_end_updating_os(step)
        note_progress(step)
        inject("after", step)
        ttp.ttp_set_ckpt_args((step, param))
        time.sleep(PLAN.get("step_sleep", 0.02))


def main() -> None:
    global RANK, WORLD, PLAN, OUT
    RANK = int(os.environ["RANK"])
    WORLD = int(os.environ["WORLD_SIZE"])
    PLAN = json.loads(os.environ.get("TTPW_PLAN", "{}"))
    OUT = PLAN.get("out", ".")
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))
    ip = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dp_ranks = list(range(WORLD))
    if RANK == 0:
        ttp.ttp_init_controller(RANK, WORLD, len(dp_ranks) // 2, False)
        ttp.ttp_start_controller(ip, 8000)
        with open(os.path.join(OUT, "..", CONTROLLER_PID_FILE), "w") as f:  # reaped by jobs.py
            f.write(str(ttp._controller.pid))
    ttp.ttp_init_processor(RANK, dp_ranks, len(dp_ranks), WORLD, len(dp_ranks) // 2, False)
    ttp.ttp_start_processor(ip, 8000)
    ttp.ttp_register_save_ckpt_handler(save)
    ttp.ttp_register_rename_handler(rename)
    ttp.ttp_set_checkpoint_dir(OUT)
    pid_file = progress_file(RANK) + ".pid"  # for a kill_host's with_ranks
    os.makedirs(os.path.dirname(pid_file), exist_ok=True)
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    param = torch.zeros(4)
    train(param, PLAN.get("steps", 20))
    print(f"worker {RANK}: finished normally", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
