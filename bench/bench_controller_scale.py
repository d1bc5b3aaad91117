"""The control plane at 1k to 100k ranks, in the production layout, one run per size.

Rank 0 is this process: a training loop of Python-driven torch ops (a 4-layer transformer
block stack, forward, backward and AdamW: tens of milliseconds a step on one core, with the
TTP hooks around the optimizer step as the patched Megatron calls them), pinned to CPU 0. It
starts the runtime through the API as the patched Megatron does: `ttp_start_controller` (the
controller in a process of its own, control/host.py; pinned to CPU 1) and
`ttp_start_processor`. Rank 1 is a real processor in a process of its own (its standby
controller is the first backup). Every other rank is simulated (testkit/simranks.py): the real
protocol over real loopback sockets, a few thousand ranks per process, kept off rank 0's CPU
while rank 0 trains. Layout: Megatron's for TP 8, PP 4 (DP groups of N/32 at stride 8, half
of each group saves). Every setting is the default for the job size (config.py).

Measured in one run per size, in this order:
  * rank 0's step time before the control plane starts (B1), with it serving N ranks (W), and
    after it has ended (B2): `ratio` = typical(W) / typical(B1 + B2), where typical() is the
    median over blocks of 10 consecutive steps of each block's fastest step: a machine shared
    with other jobs slows some stretches of steps, not rank 0's own work (the plain median's
    ratio is printed too, and the two agree on a quiet machine);
  * the registration storm: every simulated rank connects at once; time until the last one is
    registered, and the controller's CPU seconds for it;
  * the controller's CPU (% of one core) and memory (RSS) while it serves N ranks;
  * a fault: a saver's connection is reset (as when its process is killed). fault -> detected
    (the controller's fault time), -> every rank locked (the last rank got its first order),
    -> every saver has its save order, -> verdict (exit orders sent), -> every rank has its
    exit order; all bytes sent and received by every rank from just before the fault to its
    exit order (heartbeats included);
  * takeover: a fresh controller and job (storm again), then the controller process is
    SIGKILLed (node 0's controller lost): -> the standby promoted, -> every rank failed over,
    -> the standby's verdict.
Times across processes are CLOCK_MONOTONIC, one clock on one machine. A phase that does not
complete is reported as such in its row; the run goes on with the next size.

`--layout thread` runs the flow with the controller as a thread of rank 0's process (the
layout before control/host.py), for comparison; `--hogs` measures false faults instead (see
`hogs`). Sizes the machine cannot hold (file descriptors: the controller needs one per rank,
in one process; memory) are rows saying why.

    python bench/bench_controller_scale.py                      # 1024 4096 16384 65536 100000
    python bench/bench_controller_scale.py --sizes 16384        # one size, < 30 min on 2 cores
    python bench/bench_controller_scale.py --sizes 1024 4096 --layout thread
    python bench/bench_controller_scale.py --hogs --sizes 4096  # false faults under CPU hogs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mindio_ttp.demo.ports import pick_free_port  # noqa: E402

TP, PP, STEP = 8, 4, 10
FD_MARGIN = 256  # the controller's own files, pipes, listener, logs
SIM_RANKS_PER_PROC = 6000  # per simulated-ranks process (fds well under a 20,000 limit)
KEY = bytes(range(1, 33))


# -- layout ---------------------------------------------------------------------------------------
def layout(n: int) -> Callable[[int], List[int]]:
    stage = n // PP

    def dp_of(rank: int) -> List[int]:
        s, j = rank // stage, rank % TP
        return list(range(s * stage + j, (s + 1) * stage, TP))
    return dp_of


def victim_of(n: int) -> int:
    return 3 * (n // PP) + TP  # DP position 1 of a group in the last stage: a saver


# -- rank 0's training step -----------------------------------------------------------------------
def make_step() -> Callable[[], None]:
    """A Python-driven step: ~100 small torch ops dispatched one by one, then AdamW."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    hidden, heads, seq, batch = 192, 4, 48, 6

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (y.view(b, t, heads, c // heads).transpose(1, 2) for y in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / (c // heads) ** 0.5
            att = att.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    model = nn.Sequential(*[Block() for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(batch, seq, hidden)

    def step() -> None:
        import mindio_ttp.framework_ttp as ttp
        loss = model(data).square().mean()
        opt.zero_grad()
        loss.backward()
        ttp.ttp_start_updating_os(-1)
        opt.step()
        ttp.ttp_end_updating_os(STEP)  # the job stays at one step: every rank reports STEP
    return step


def typical(times: List[float], block: int = 10) -> float:
    """Median over blocks of `block` consecutive steps of each block's fastest step."""
    return statistics.median(min(times[i:i + block]) for i in range(0, len(times), block))


def time_steps(step: Callable[[], None], seconds: float, min_steps: int = 30) -> List[float]:
    out: List[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(out) < min_steps:
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


# -- one size, in a process of its own ------------------------------------------------------------
class Phase:
    """Which phase a run reached: an incomplete run says where it stopped."""

    def __init__(self, result: Dict[str, Any]) -> None:
        self.result = result

    def __call__(self, name: str) -> None:
        self.result["phase"] = name
        print(f"# {self.result['n']} {self.result['layout']}: {name}", file=sys.stderr,
              flush=True)


def pin(pid: int, cpus: set) -> None:
    if len(os.sched_getaffinity(0) | cpus) > 1:
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            pass


def cpu_s(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rss_mib(pid: int) -> float:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


def job(n: int, out: Dict[str, Any]) -> Tuple[Dict[str, str], Any, Callable[[int], List[int]],
                                             int, Callable[[], None]]:
    """What every measurement of `n` ranks shares: the environment the runtime reads (also
    this process's), the settings it derives for `n`, the layout and rank 0's step."""
    from mindio_ttp.config import TTPConfig

    env = {"TTP_AUTH_KEY": KEY.hex(), "TTP_LOG_LEVEL": "ERROR", "TTP_OT": "600"}
    os.environ.update(env)
    cfg = TTPConfig.from_env(world_size=n)
    out["interval"], out["timeout"] = cfg.heartbeat_interval, cfg.heartbeat_timeout
    return env, cfg, layout(n), n // PP // TP // 2, make_step()


def run_one(n: int, layout_name: str, window: float, out: Dict[str, Any]) -> None:
    import torch

    import mindio_ttp.framework_ttp as ttp
    from mindio_ttp.control.controller import Controller
    from testkit.simranks import RealRank, SimGroup

    phase = Phase(out)
    cpus = sorted(os.sched_getaffinity(0))
    rank0_cpu, other_cpus = {cpus[0]}, set(cpus[1:]) or {cpus[0]}
    pin(0, rank0_cpu)
    torch.set_num_threads(1)
    env, cfg, dp_of, replica, step = job(n, out)
    time_steps(step, 2.0, 10)  # warm-up

    phase("baseline before")
    b1 = time_steps(step, window / 2)

    phase("control plane start")
    t_start = time.monotonic()
    if layout_name == "process":
        ttp.ttp_init_controller(0, n, replica, False)
        ttp.ttp_start_controller("127.0.0.1", pick_free_port())
        host = ttp._controller
        ctl_pid, addr = host.pid, host.address
        pin(ctl_pid, other_cpus)
    else:
        ctl = Controller(cfg, n, replica, host_rank=0)
        addr = ctl.listen("127.0.0.1", pick_free_port())
        ctl.start()
        ctl_pid = os.getpid()
    out["controller_start_s"] = time.monotonic() - t_start
    ttp.ttp_init_processor(0, dp_of(0), len(dp_of(0)), n, replica, False)
    ttp.ttp_start_processor(*addr)
    ttp._processor.exit_fn = lambda code: None  # the bench goes on after the exit order
    ttp.ttp_register_save_ckpt_handler(lambda step, ranks, args: None)  # rank 0 saves (nothing)
    ttp.ttp_register_rename_handler(lambda step, args: None)
    real = RealRank(env, 1, dp_of(1), n, replica, addr, STEP, cpus=other_cpus)
    sims = SimGroup(range(2, n), n, dp_of, replica, KEY, cfg.heartbeat_interval, STEP,
                    procs=max(1, -(-n // SIM_RANKS_PER_PROC)), cpus=rank0_cpu)
    try:
        phase("registration storm")
        c0 = cpu_s(ctl_pid)
        t0 = time.monotonic()
        sims.ask("connect", addr)
        if not sims.wait_registered(n - 2, 600):
            raise RuntimeError(f"only {sum(sims.ask('registered'))} of {n - 2} simulated ranks "
                               "registered within 600 s")
        last = max(r.registered_at for r in sims.records().values())
        out["storm_s"] = last - t0
        out["storm_ctl_cpu_s"] = cpu_s(ctl_pid) - c0

        phase("steady state")
        sims.pin(other_cpus)  # rank 0's CPU is its own while it trains
        time.sleep(cfg.heartbeat_interval + 1)  # heartbeats spread over the interval
        c0, t0 = cpu_s(ctl_pid), time.monotonic()
        w = time_steps(step, window)
        out["ctl_cpu_pct"] = (cpu_s(ctl_pid) - c0) / (time.monotonic() - t0) * 100
        out["ctl_rss_mib"] = rss_mib(ctl_pid)
        out["hb_per_s"] = n / cfg.heartbeat_interval
        out["ctl_us_per_hb"] = out["ctl_cpu_pct"] * 1e4 / out["hb_per_s"]

        phase("fault flow")
        sims.pin(rank0_cpu)  # rank 0 stops training at the fault: its CPU goes to the ranks
        sims.ask("mark")
        victim = victim_of(n)
        c0 = cpu_s(ctl_pid)
        t_fault = sims.ask_rank(victim, "abort", victim)
        if layout_name == "process":
            flow = host.flow_report(300)
            if flow is None:
                raise RuntimeError(f"no verdict within 300 s: {host.status()}")
            tl, outcome = flow["timeline"], flow["outcome"]
            out["flow_ctl_cpu_s"] = flow["cpu_s"] - c0
        else:
            if not ctl.decided.wait(300):
                raise RuntimeError("no verdict within 300 s")
            tl, outcome = dict(ctl.timeline), ctl.decision.outcome.value
        out["outcome"] = outcome
        out["detect_ms"] = (tl["fault"] - t_fault) * 1e3
        out["verdict_ms"] = (tl["exit_sent"] - t_fault) * 1e3
        deadline = time.monotonic() + 60
        while True:
            recs = sims.records()
            live = [r for r in recs.values() if r.rank != victim]
            waiting = sum(not any(o.kind == "ExitOrder" for o in r.orders) for r in live)
            out["no_exit_order"] = waiting
            if not waiting or time.monotonic() > deadline:
                break  # ranks without their exit order 60 s after the verdict: in the row
            time.sleep(0.2)

        def last(kind: str) -> float:
            return max((o.at for r in live for o in r.orders if o.kind == kind),
                       default=float("nan"))
        out["all_locked_ms"] = (last("Lock") - t_fault) * 1e3
        out["all_saves_ms"] = (last("SaveOrder") - t_fault) * 1e3
        out["all_exits_ms"] = (last("ExitOrder") - t_fault) * 1e3
        out["bytes"] = sum(r.bytes_in + r.bytes_out for r in recs.values())
        out["bytes_per_rank"] = out["bytes"] / len(recs)
        real.close()
        ttp.ttp_shutdown()  # reaps the controller process, which exited after its flow
        if layout_name == "thread":
            ctl.stop()

        phase("baseline after")
        pin(0, rank0_cpu)
        sims.pin(other_cpus)
        b2 = time_steps(step, window / 2)
        base = typical(b1 + b2)
        out["step_ms_without"] = base * 1e3
        out["step_ms_with"] = typical(w) * 1e3
        out["ratio"] = typical(w) / base
        out["ratio_median"] = statistics.median(w) / statistics.median(b1 + b2)
        out["ab_noise"] = typical(b2) / typical(b1)  # the same work before and after: noise

        if layout_name == "process":
            phase("takeover")
            takeover(n, cfg, env, dp_of, replica, sims, other_cpus, rank0_cpu, out)
        phase("done")
    finally:
        sims.close()
        real.close()


def takeover(n: int, cfg: Any, env: Dict[str, str], dp_of: Callable[[int], List[int]],
             replica: int, sims: Any, other_cpus: set, rank0_cpu: set,
             out: Dict[str, Any]) -> None:
    """A fresh job (rank 0 absent: counted dead), then its controller process is killed."""
    from mindio_ttp.control.host import ControllerProcess
    from testkit.simranks import RealRank

    sims.ask("reset")
    host = ControllerProcess(cfg, n, replica, host_rank=0)
    addr = host.start("127.0.0.1", 0)
    pin(host.pid, other_cpus)
    real = RealRank(env, 1, dp_of(1), n, replica, addr, STEP, cpus=other_cpus)
    try:
        sims.pin(rank0_cpu)
        t0 = time.monotonic()
        sims.ask("connect", addr)
        if not sims.wait_registered(n - 2, 600):
            raise RuntimeError("takeover: the second storm did not complete")
        out["storm2_s"] = max(r.registered_at for r in sims.records().values()) - t0
        deadline = time.monotonic() + 60
        while not all(b and b[0][0] == 1 for b in sims.ask("backups")):
            if time.monotonic() > deadline:
                raise RuntimeError("takeover: the standby was not announced within 60 s")
            time.sleep(0.2)
        t_kill = time.monotonic()
        os.kill(host.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while True:
            rep = real.report()
            if rep["standby_outcome"] is not None and "exit_sent" in rep["timeline"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"takeover: no verdict within 300 s ({rep['standby_state']})")
            time.sleep(0.2)
        tl = rep["timeline"]
        out["takeover_promoted_ms"] = (tl["fault"] - t_kill) * 1e3
        out["takeover_verdict_ms"] = (tl["exit_sent"] - t_kill) * 1e3
        out["takeover_outcome"] = rep["standby_outcome"]
        time.sleep(1)
        moved = [r.failed_over_at for r in sims.records().values()]
        if all(moved):
            out["takeover_all_ms"] = (max(moved) - t_kill) * 1e3  # type: ignore[type-var]
    finally:
        real.close()
        host.stop()


# -- false faults under load ----------------------------------------------------------------------
def hogs(n: int, window: float, out: Dict[str, Any]) -> None:
    """Default settings for `n` ranks; no fault is injected. Three windows: CPU hogs (4 busy
    processes) on the controller's CPU, then on the CPU of rank 0 and the simulated ranks,
    then pauses: every 2 x timeout, rank 0's training thread holds the GIL for 0.6 x timeout
    (a long GC pause) and one simulated-ranks process is SIGSTOPped as long. Any fault the
    controller declares, any rank that fails over, is false."""
    import mindio_ttp.framework_ttp as ttp
    from testkit.simranks import SimGroup

    phase = Phase(out)
    cpus = sorted(os.sched_getaffinity(0))
    rank_cpu, ctl_cpu = {cpus[0]}, {cpus[-1]}
    pin(0, rank_cpu)
    env, cfg, dp_of, replica, step = job(n, out)
    ttp.ttp_init_controller(0, n, replica, False)
    ttp.ttp_start_controller("127.0.0.1", pick_free_port())
    host = ttp._controller
    pin(host.pid, ctl_cpu)
    ttp.ttp_init_processor(0, dp_of(0), len(dp_of(0)), n, replica, False)
    ttp.ttp_start_processor("127.0.0.1", host.address[1])
    ttp._processor.exit_fn = lambda code: None  # a false fault must not end the bench
    procs = max(2, -(-n // SIM_RANKS_PER_PROC))
    sims = SimGroup(range(1, n), n, dp_of, replica, KEY, cfg.heartbeat_interval, STEP,
                    procs=procs, cpus=rank_cpu)
    stopped = len(range(1, n)[0::procs])
    spinners: List[subprocess.Popen] = []
    try:
        phase("registration")
        sims.ask("connect", host.address)
        if not sims.wait_registered(n - 1, 600):
            raise RuntimeError("registration did not complete")

        def hog(where: set) -> None:
            for _ in range(4):
                p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                pin(p.pid, where)
                spinners.append(p)

        def unhog() -> None:
            for p in spinners:
                p.kill()
                p.wait()
            spinners.clear()

        t = time.perf_counter()
        sum(range(10_000_000))
        per_item = (time.perf_counter() - t) / 10_000_000

        def train(seconds: float, pause: float = 0.0) -> None:
            end = time.monotonic() + seconds
            next_pause = time.monotonic() + 2 * cfg.heartbeat_timeout
            while time.monotonic() < end:
                step()
                if pause and time.monotonic() >= next_pause:
                    os.kill(sims.pids[0], signal.SIGSTOP)
                    sum(range(int(pause / per_item)))  # one C call: the GIL is never released
                    os.kill(sims.pids[0], signal.SIGCONT)
                    next_pause = time.monotonic() + 2 * cfg.heartbeat_timeout

        rows = []
        for name, setup, pause in (("CPU hog on the controller's CPU", lambda: hog(ctl_cpu), 0),
                                   ("CPU hog on the ranks' CPU", lambda: hog(rank_cpu), 0),
                                   (f"GIL pause of rank 0 + SIGSTOP of {stopped} simulated "
                                    f"ranks, {0.6 * cfg.heartbeat_timeout:g} s each",
                                    lambda: None, 0.6 * cfg.heartbeat_timeout)):
            phase(name)
            setup()
            train(window, pause)
            unhog()
            time.sleep(cfg.heartbeat_timeout + 1)  # anything declared late shows up now
            st = host.status() or {}
            moved = sum(1 for r in sims.records().values() if r.failed_over_at is not None)
            rows.append({"load": name, "faults": st.get("n_faults"),
                         "failovers": moved + (1 if ttp._processor.fault_seen else 0),
                         "heartbeats": int(n * window / cfg.heartbeat_interval),
                         "first": (st.get("faults") or [""])[0][:120]})
        out["hog_rows"] = rows
        phase("done")
    finally:
        for p in spinners:
            p.kill()
        sims.close()
        ttp.ttp_shutdown()


# -- the outer loop -------------------------------------------------------------------------------
def can_run(n: int) -> Optional[str]:
    """Why this machine cannot hold `n` ranks (None when it can)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + FD_MARGIN
    if hard != resource.RLIM_INFINITY and hard < need:
        return (f"not run: the controller holds one socket per rank in one process and needs "
                f"{need} files; RLIMIT_NOFILE's hard limit here is {hard} (raising it needs "
                "CAP_SYS_RESOURCE, which this machine does not give)")
    try:
        import psutil
        avail = psutil.virtual_memory().available
    except ImportError:
        return None
    need_mem = n * 64 * 1024  # both socket ends, the controller's and the simulation's state
    if avail < need_mem:
        return f"not run: ~{need_mem >> 30} GiB needed, {avail >> 30} GiB available"
    return None


def fmt(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def row(r: Dict[str, Any]) -> str:
    if "skip" in r:
        return f"| {r['n']} | {r['layout']} | {r['skip']} |"
    done = r.get("phase") == "done"
    cols = [
        r["n"], r["layout"], fmt(r.get("interval"), "g"), fmt(r.get("storm_s"), ".1f"),
        fmt(r.get("storm_ctl_cpu_s"), ".1f"), fmt(r.get("step_ms_without"), ".1f"),
        fmt(r.get("step_ms_with"), ".1f"),
        f"ratio {r['ratio']:.3f} (median {r['ratio_median']:.3f}, B2/B1 {r['ab_noise']:.3f})"
        if r.get("ratio") else "-",
        f"{fmt(r.get('ctl_cpu_pct'), '.1f')} ({fmt(r.get('ctl_us_per_hb'))} us/hb)",
        fmt(r.get("ctl_rss_mib")),
        fmt(r.get("flow_ctl_cpu_s"), ".2f"),
        fmt(r.get("detect_ms"), ".1f"), fmt(r.get("all_locked_ms")),
        fmt(r.get("all_saves_ms")), fmt(r.get("verdict_ms")), fmt(r.get("all_exits_ms")),
        f"{fmt(r.get('bytes'))} ({fmt(r.get('bytes_per_rank'))})",
        " / ".join(fmt(r.get(k)) for k in ("takeover_promoted_ms", "takeover_all_ms",
                                            "takeover_verdict_ms")),
        (r.get("outcome", "-") + (f", {r['no_exit_order']} rank(s) without an exit order"
                                  if r.get("no_exit_order") else ""))
        if done else f"incomplete at {r.get('phase')}: {r.get('error', '?')}",
    ]
    return "| " + " | ".join(map(str, cols)) + " |"


HEAD = ("N", "layout", "heartbeat s", "storm s", "storm ctl CPU s", "rank-0 step ms without",
        "with", "ratio", "ctl CPU % (per heartbeat)", "ctl RSS MiB", "flow ctl CPU s", "detect ms",
        "all locked ms",
        "all save orders ms", "verdict ms", "all exit orders ms", "bytes per flow (per rank)",
        "takeover ms: promoted / all moved / verdict", "outcome")


def run_size(n: int, layout_name: str, args: argparse.Namespace) -> Dict[str, Any]:
    why = can_run(n)
    if why:
        return {"n": n, "layout": layout_name, "skip": why}
    cmd = [sys.executable, __file__, "--one", str(n), "--layout", layout_name,
           "--window", str(args.window)] + (["--hogs"] if args.hogs else [])
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, timeout=args.timeout,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        lines = [ln for ln in p.stdout.decode().splitlines() if ln.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        return {"n": n, "layout": layout_name, "phase": "start",
                "error": f"exit status {p.returncode}"}
    except subprocess.TimeoutExpired:
        return {"n": n, "layout": layout_name, "phase": "?",
                "error": f"killed after {args.timeout} s"}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 100000])
    ap.add_argument("--layout", choices=["process", "thread"], default="process")
    ap.add_argument("--window", type=float, default=40.0,
                    help="seconds of rank-0 training with the control plane (and as much without)")
    ap.add_argument("--hogs", action="store_true", help="measure false faults under load")
    ap.add_argument("--timeout", type=float, default=1700.0, help="per size, seconds")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        out: Dict[str, Any] = {"n": a.one, "layout": a.layout, "phase": "start"}
        try:
            if a.hogs:
                hogs(a.one, a.window, out)
            else:
                run_one(a.one, a.layout, a.window, out)
        except Exception as exc:  # noqa: BLE001 - an incomplete flow is a row, not a crash
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(out), flush=True)
        os._exit(0)  # daemon helpers and the runtime's threads: nothing left to wait for
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.1f}; layout TP {TP} x PP {PP}; defaults for each size",
          flush=True)
    results = []
    for n in a.sizes:
        r = run_size(n, a.layout, a)
        results.append(r)
        if a.hogs:
            for h in r.get("hog_rows", []):
                print(f"{n} ranks, heartbeat {r['interval']:g} s / timeout {r['timeout']:g} s, "
                      f"{h['load']}: {h['faults']} false fault(s), {h['failovers']} false "
                      f"failover(s) in {h['heartbeats']} heartbeats {h['first']}", flush=True)
            if "hog_rows" not in r:
                print(row(r), flush=True)
        else:
            print(f"{n} {a.layout} ... ratio {r['ratio']:.3f}" if r.get("ratio") else row(r),
                  flush=True)
    if not a.hogs:
        print("| " + " | ".join(HEAD) + " |")
        print("|" + "---|" * len(HEAD))
        for r in results:
            print(row(r))
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
