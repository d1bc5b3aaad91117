"""The control plane in tiers at 16k to 100k ranks, in the production layout, one run per size.

Rank 0 is this process: a training loop of Python-driven torch ops (a 4-layer transformer
block stack, forward, backward and AdamW: tens of milliseconds a step on one core, with the
TTP hooks around the optimizer step as the patched Megatron calls them), pinned to CPU 0. It
starts the runtime through the API as the patched Megatron does: `ttp_start_controller` (the
controller in a process of its own, control/controller/host.py) and `ttp_start_processor`, which
registers through node 0's agent. Node 0 (ranks 0-7) is real: its node agent
(control/agent/node.py, in a process of its own as ttprun's would be), rank 0, rank 1 (a real
processor in its own process, whose standby is the first backup) and ranks 2-7 (simulated
ranks speaking the real rank protocol to the real agent over AF_UNIX, testkit/simranks.py).
The relays are real node agents (testkit/agenthost.py) that register first, so that the
controller serves them itself (TTP_FANOUT's default: the square root of the nodes, at least
32); every other node is a simulated node agent (testkit/simagents.py: the real tier protocol
over real sockets, split over processes so that no process holds more than a few thousand
sockets) that the controller redirects to a relay. Layout: Megatron's for TP 8, PP 4 (PP 5 at
100,000 ranks, whose PP 4 would leave odd DP groups; DP
groups of N/32 at stride 8, half of each group saves). Every setting is the default.
CPU 0: rank 0; CPU 1: the controller, node 0's agent and rank 1, the relays and the
simulation (also on CPU 0 while rank 0 does not train: storm and flow).

Measured in one run per size, in this order:
  * the registration storm: every simulated agent connects at once; time until the last rank is
    welcomed (the relays registered before it), and the controller's CPU seconds for it;
  * rank 0's step time before the control plane starts (B1), with it serving N ranks (W), and
    after it has ended (B2): `ratio` = typical(W) / typical(B1 + B2), where typical() is the
    median over blocks of 10 consecutive steps of each block's fastest step;
  * the controller's CPU (% of one core) and memory (RSS) while it serves N ranks;
  * a fault: rank 1's process is SIGSTOPped (hung: its processor stops heartbeating to node
    0's agent). -> hung rank seen (the controller's fault time), then from that moment:
    -> every rank locked (the last simulated node agent, or node 0's simulated ranks, to get
    its lock order), -> every saver has its save order, -> verdict (exit orders sent),
    -> every rank has its exit order; bytes sent and received on every simulated node agent's
    link and node 0's simulated ranks' local links, from just before the fault to the exit.
Times across processes are CLOCK_MONOTONIC, one clock on one machine. A phase that does not
complete is reported as such in its row; the run goes on with the next size.

`--hogs` measures false faults instead (see `hogs`).

    python bench/bench_controller_scale.py --sizes 16384 65536 100000
    python bench/bench_controller_scale.py --hogs --sizes 16384
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mindio_ttp.demo.ports import pick_free_port  # noqa: E402

TP, STEP = 8, 10
PER_NODE = 8  # ranks per node
SIM_AGENTS_PER_PROC = 3200  # per simulated-agents process (fds well under a 20,000 limit)
RELAYS_PER_HOST = 32  # real relays per helper process
KEY = bytes(range(1, 33))


# -- layout ---------------------------------------------------------------------------------------
def stages(n: int) -> int:
    """PP 4, or 5 where 4 leaves DP groups of an odd size (100,000 ranks: 3,125), which no
    ReplicatedOptimizer holds (every shard on two ranks)."""
    for pp in (4, 5, 2, 8, 1):
        if n % (pp * TP) == 0 and (n // pp // TP) % 2 == 0:
            return pp
    raise ValueError(f"{n} ranks make no even DP groups at TP {TP}")


@dataclass(frozen=True)
class Layout:
    """rank -> its DP group; a class, not a closure: the helper processes get it pickled."""
    stage: int

    def __call__(self, rank: int) -> List[int]:
        s, j = rank // self.stage, rank % TP
        return list(range(s * self.stage + j, (s + 1) * self.stage, TP))


def layout(n: int) -> Callable[[int], List[int]]:
    return Layout(n // stages(n))


def victim_of(n: int) -> int:
    return (stages(n) - 1) * (n // stages(n)) + TP  # DP position 1, last stage: a saver


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
        print(f"# {self.result['n']}: {name}", file=sys.stderr, flush=True)


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
    if os.environ.get("BENCH_HEARTBEAT_TIMEOUT"):  # --heartbeat-timeout: not the default
        env["TTP_HEARTBEAT_TIMEOUT"] = os.environ["BENCH_HEARTBEAT_TIMEOUT"]
    os.environ.update(env)
    cfg = TTPConfig.from_env(world_size=n)
    out["interval"], out["timeout"] = cfg.heartbeat_interval, cfg.heartbeat_timeout
    out["pp"] = stages(n)
    return env, cfg, layout(n), n // stages(n) // TP // 2, make_step()


class Tiers:
    """Node 0 (its real agent, rank 1, simulated ranks 2-7), the real relays and the simulated
    node agents of every other node, around a controller at `addr`."""

    def __init__(self, n: int, cfg: Any, env: Dict[str, str], dp_of: Callable[[int], List[int]],
                 replica: int, addr: Tuple[str, int], node0_cpus: set, sim_cpus: set) -> None:
        from mindio_ttp.control.agent.node import AgentSettings
        from mindio_ttp.control.controller.routes import DEFAULT_LOCAL_WORLD, MIN_FANOUT
        from testkit.agenthost import AgentHost
        from testkit.simagents import SimAgentGroup, nodes_of
        from testkit.simranks import RealRank, SimGroup

        self.parts: List[Any] = []
        settings = AgentSettings(n, cfg.heartbeat_interval, cfg.heartbeat_timeout,
                                 cfg.handshake_timeout, cfg.connect_timeout, cfg.ot, PER_NODE)
        self.node0 = AgentHost(KEY, settings, 1, cpus=node0_cpus)
        self.parts.append(self.node0)
        self.path = self.node0.paths[0]
        nodes = -(-n // PER_NODE)
        k = max(MIN_FANOUT, math.ceil(math.sqrt(nodes)))
        assert DEFAULT_LOCAL_WORLD == PER_NODE
        self.fanout = k
        self.relays: List[Any] = []
        left = k - 1  # node 0's agent is the controller's first
        while left > 0:
            take = min(RELAYS_PER_HOST, left)
            self.relays.append(AgentHost(KEY, settings, take, controller=addr, cpus=node0_cpus))
            left -= take
        self.parts += self.relays
        self.real = RealRank(dict(env, TTP_AGENT_SOCKET=self.path), 1, dp_of(1), n, replica,
                             addr, STEP, cpus=node0_cpus)
        self.parts.append(self.real)
        self.local = SimGroup(range(2, PER_NODE), n, dp_of, replica, KEY,
                              cfg.heartbeat_interval, STEP, procs=1, cpus=node0_cpus,
                              agents={r: self.path for r in range(2, PER_NODE)})
        self.parts.append(self.local)
        rest = nodes_of(range(PER_NODE, n), PER_NODE)
        self.sims = SimAgentGroup(rest, n, dp_of, replica, KEY, cfg.heartbeat_interval,
                                  cfg.heartbeat_timeout, STEP,
                                  procs=max(2, -(-len(rest) // SIM_AGENTS_PER_PROC)),
                                  cpus=sim_cpus)
        self.parts.append(self.sims)

    def pin(self, cpus: set) -> None:
        self.sims.pin(cpus)
        self.local.pin(cpus)

    def relay_cpu_s(self) -> float:
        """CPU seconds of every real relay and of node 0's agent, together."""
        return sum(cpu_s(h.pid) for h in [self.node0] + self.relays)

    def sims_cpu_s(self) -> float:
        """CPU seconds of every simulated-agents process, together: on a cluster each node's
        agent has a core of its own; here they take the controller's and the relays' cores."""
        return sum(cpu_s(pid) for pid in self.sims.pids)

    def close(self) -> None:
        for part in reversed(self.parts):
            try:
                part.close()
            except Exception:  # noqa: BLE001 - the next part must be closed too
                pass


def wait_children(host: Any, want: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        st = host.status() or {}
        if st.get("children", 0) >= want or time.monotonic() > deadline:
            return int(st.get("children", 0))
        time.sleep(0.1)


def run_one(n: int, window: float, out: Dict[str, Any]) -> None:
    import torch

    import mindio_ttp.framework_ttp as ttp

    phase = Phase(out)
    cpus = sorted(os.sched_getaffinity(0))
    rank0_cpu, other_cpus = {cpus[0]}, set(cpus[1:]) or {cpus[0]}
    all_cpus = set(cpus)
    pin(0, rank0_cpu)
    torch.set_num_threads(1)
    env, cfg, dp_of, replica, step = job(n, out)
    time_steps(step, 2.0, 10)  # warm-up

    phase("baseline before")
    b1 = time_steps(step, window / 2)

    phase("control plane start")
    ttp.ttp_init_controller(0, n, replica, False)
    ttp.ttp_start_controller("127.0.0.1", pick_free_port())
    host = ttp._controller
    ctl_pid, addr = host.pid, host.address
    pin(ctl_pid, other_cpus)
    tiers = Tiers(n, cfg, env, dp_of, replica, addr, other_cpus, all_cpus)
    try:
        os.environ["TTP_AGENT_SOCKET"] = tiers.path
        ttp.ttp_init_processor(0, dp_of(0), len(dp_of(0)), n, replica, False)
        ttp.ttp_start_processor(*addr)
        ttp._processor.exit_fn = lambda code: None  # the bench goes on after the exit order
        ttp.ttp_register_save_ckpt_handler(lambda step, ranks, args: None)
        ttp.ttp_register_rename_handler(lambda step, args: None)
        tiers.local.ask("connect", addr)
        if not tiers.local.wait_registered(PER_NODE - 2, 120):
            raise RuntimeError("node 0's simulated ranks did not register")
        out["fanout"] = tiers.fanout
        out["relays_up"] = wait_children(host, tiers.fanout, 120)

        phase("registration storm")
        c0, r0, s0 = cpu_s(ctl_pid), tiers.relay_cpu_s(), tiers.sims_cpu_s()
        t0 = time.monotonic()
        tiers.sims.ask("connect", addr)
        if not tiers.sims.wait_registered(n - PER_NODE, 1200):
            raise RuntimeError(f"only {sum(tiers.sims.ask('registered'))} of {n - PER_NODE} "
                               f"simulated ranks registered within 1200 s; {host.status()}")
        out["storm_s"] = tiers.sims.summary()["registered_last"] - t0
        out["storm_ctl_cpu_s"] = cpu_s(ctl_pid) - c0
        out["storm_relay_cpu_s"] = (tiers.relay_cpu_s() - r0) / tiers.fanout  # per relay
        out["storm_sims_cpu_s"] = tiers.sims_cpu_s() - s0
        st = host.status() or {}
        out["ctl_children"], out["routed"] = st.get("children"), st.get("routed")

        phase("steady state")
        tiers.pin(other_cpus)  # rank 0's CPU is its own while it trains
        time.sleep(cfg.heartbeat_interval + 1)
        c0, t0 = cpu_s(ctl_pid), time.monotonic()
        w = time_steps(step, window)
        out["ctl_cpu_pct"] = (cpu_s(ctl_pid) - c0) / (time.monotonic() - t0) * 100
        out["ctl_rss_mib"] = rss_mib(ctl_pid)
        out["ctl_fds"] = len(os.listdir(f"/proc/{ctl_pid}/fd"))

        phase("fault flow")
        tiers.pin(all_cpus)  # rank 0 stops training at the fault: its CPU goes to the simulation
        tiers.sims.ask("mark")
        tiers.local.ask("mark")
        c0, r0, s0 = cpu_s(ctl_pid), tiers.relay_cpu_s(), tiers.sims_cpu_s()
        t_stop = time.monotonic()
        os.kill(tiers.real.proc.pid, signal.SIGSTOP)
        try:
            flow = host.flow_report(300)
        finally:
            os.kill(tiers.real.proc.pid, signal.SIGCONT)
        if flow is None:
            raise RuntimeError(f"no verdict within 300 s: {host.status()}")
        tl = flow["timeline"]
        out["outcome"] = flow["outcome"]
        out["flow_ctl_cpu_s"] = flow["cpu_s"] - c0
        out["hang_seen_s"] = tl["fault"] - t_stop
        out["verdict_ms"] = (tl["exit_sent"] - tl["fault"]) * 1e3
        deadline = time.monotonic() + 120
        while True:
            summ = tiers.sims.summary()
            local = tiers.local.records()
            waiting = summ["ranks"] - summ["count"].get("ExitOrder", 0) + sum(
                not any(o.kind == "ExitOrder" for o in r.orders) for r in local.values())
            out["no_exit_order"] = waiting
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.5)

        def last(kind: str) -> float:
            t = max([summ["last"].get(kind, float("nan"))] +
                    [o.at for r in local.values() for o in r.orders if o.kind == kind])
            return (t - tl["fault"]) * 1e3
        out["all_locked_ms"] = last("Lock")
        out["all_saves_ms"] = last("SaveOrder")
        out["all_exits_ms"] = last("ExitOrder")
        out["flow_relay_cpu_s"] = (tiers.relay_cpu_s() - r0) / tiers.fanout  # per relay
        out["flow_sims_cpu_s"] = tiers.sims_cpu_s() - s0
        out["sim_failovers"] = summ["failed_over"]
        out["relay_failovers"] = sum(a["failovers"] for h in [tiers.node0] + tiers.relays
                                     for a in h.status())
        out["bytes"] = summ["bytes"] + sum(r.bytes_in + r.bytes_out for r in local.values())
        out["bytes_per_rank"] = out["bytes"] / (summ["ranks"] + len(local))
        ttp.ttp_shutdown()

        phase("baseline after")
        pin(0, rank0_cpu)
        tiers.pin(other_cpus)
        b2 = time_steps(step, window / 2)
        base = typical(b1 + b2)
        out["step_ms_without"] = base * 1e3
        out["step_ms_with"] = typical(w) * 1e3
        out["ratio"] = typical(w) / base
        out["ratio_median"] = statistics.median(w) / statistics.median(b1 + b2)
        out["ab_noise"] = typical(b2) / typical(b1)
        phase("done")
    finally:
        os.environ.pop("TTP_AGENT_SOCKET", None)
        tiers.close()


# -- false faults under load ----------------------------------------------------------------------
def hogs(n: int, window: float, out: Dict[str, Any]) -> None:
    """Default settings for `n` ranks; no fault is injected. Three windows: 4 CPU hogs on the CPU
    of node 0's agent and ranks (an agent's node), then on the controller's CPU (it shares it
    with the relays), then pauses: every 2 x timeout, rank 0's training thread holds the GIL
    for 0.6 x timeout (a long GC pause) and one simulated-agents process is SIGSTOPped as long.
    Any fault the controller declares, any rank or agent that fails over, is false."""
    import mindio_ttp.framework_ttp as ttp

    phase = Phase(out)
    cpus = sorted(os.sched_getaffinity(0))
    node0_cpu, ctl_cpu = {cpus[0]}, {cpus[-1]}
    pin(0, node0_cpu)
    env, cfg, dp_of, replica, step = job(n, out)
    ttp.ttp_init_controller(0, n, replica, False)
    ttp.ttp_start_controller("127.0.0.1", pick_free_port())
    host = ttp._controller
    pin(host.pid, ctl_cpu)
    tiers = Tiers(n, cfg, env, dp_of, replica, host.address, node0_cpu, set(cpus))
    spinners: List[subprocess.Popen] = []
    try:
        os.environ["TTP_AGENT_SOCKET"] = tiers.path
        ttp.ttp_init_processor(0, dp_of(0), len(dp_of(0)), n, replica, False)
        ttp.ttp_start_processor(*host.address)
        ttp._processor.exit_fn = lambda code: None  # a false fault must not end the bench
        phase("registration")
        tiers.local.ask("connect", host.address)
        wait_children(host, tiers.fanout, 120)
        tiers.sims.ask("connect", host.address)
        if not tiers.sims.wait_registered(n - PER_NODE, 1200):
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
                    os.kill(tiers.sims.pids[0], signal.SIGSTOP)
                    sum(range(int(pause / per_item)))  # one C call: the GIL is never released
                    os.kill(tiers.sims.pids[0], signal.SIGCONT)
                    next_pause = time.monotonic() + 2 * cfg.heartbeat_timeout

        rows = []
        for name, setup, pause in (("CPU hog on node 0's CPU (its agent and ranks)",
                                    lambda: hog(node0_cpu), 0),
                                   ("CPU hog on the controller's CPU", lambda: hog(ctl_cpu), 0),
                                   (f"GIL pause of rank 0 + SIGSTOP of 1/{len(tiers.sims.pids)} "
                                    f"of the simulated agents, {0.6 * cfg.heartbeat_timeout:g} "
                                    "s each", lambda: None, 0.6 * cfg.heartbeat_timeout)):
            phase(name)
            setup()
            train(window, pause)
            unhog()
            time.sleep(cfg.heartbeat_timeout + 1)  # anything declared late shows up now
            st = host.status() or {}
            summ = tiers.sims.summary()
            agents = tiers.node0.status() + [s for h in tiers.relays for s in h.status()]
            rows.append({"load": name, "faults": st.get("n_faults"),
                         "failovers": summ["failed_over"] + sum(a["failovers"] for a in agents)
                         + (1 if ttp._processor.fault_seen else 0),
                         "heartbeats": int(n * window / cfg.heartbeat_interval),
                         "first": (st.get("faults") or [""])[0][:120]})
        out["hog_rows"] = rows
        phase("done")
    finally:
        for p in spinners:
            p.kill()
        os.environ.pop("TTP_AGENT_SOCKET", None)
        tiers.close()
        ttp.ttp_shutdown()


# -- the outer loop -------------------------------------------------------------------------------
def can_run(n: int) -> Optional[str]:
    """Why this machine cannot hold `n` ranks (None when it can)."""
    try:
        import psutil
        avail = psutil.virtual_memory().available
    except ImportError:
        return None
    need_mem = n * 24 * 1024  # simulated agents' state and both ends of their sockets
    if avail < need_mem:
        return f"not run: ~{need_mem >> 30} GiB needed, {avail >> 30} GiB available"
    return None


def fmt(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def row(r: Dict[str, Any]) -> str:
    if "skip" in r:
        return f"| {r['n']} | {r['skip']} |"
    done = r.get("phase") == "done"
    cols = [
        r["n"], f"{fmt(r.get('fanout'))} / {fmt(r.get('ctl_children'))}",
        fmt(r.get("storm_s"), ".1f"),
        f"{fmt(r.get('storm_ctl_cpu_s'), '.2f')} / {fmt(r.get('storm_relay_cpu_s'), '.3f')}"
        f" / {fmt(r.get('storm_sims_cpu_s'), '.1f')}",
        f"{fmt(r.get('step_ms_without'), '.1f')} / {fmt(r.get('step_ms_with'), '.1f')}",
        f"{r['ratio']:.3f} (median {r['ratio_median']:.3f}, B2/B1 {r['ab_noise']:.3f})"
        if r.get("ratio") else "-",
        fmt(r.get("ctl_cpu_pct"), ".2f"), fmt(r.get("ctl_rss_mib")), fmt(r.get("ctl_fds")),
        fmt(r.get("hang_seen_s"), ".2f") + (f" (timeout {r['timeout']:g})"
                                           if r.get("timeout") not in (None, 6.0) else ""),
        fmt(r.get("all_locked_ms")),
        fmt(r.get("all_saves_ms")), fmt(r.get("verdict_ms")), fmt(r.get("all_exits_ms")),
        f"{fmt(r.get('flow_ctl_cpu_s'), '.2f')} / {fmt(r.get('flow_relay_cpu_s'), '.3f')}"
        f" / {fmt(r.get('flow_sims_cpu_s'), '.1f')}",
        fmt(r.get("bytes_per_rank")),
        (r.get("outcome", "-") + (f", {r['no_exit_order']} rank(s) without an exit order"
                                  if r.get("no_exit_order") else "")
         + (f", {r['sim_failovers']} simulated rank(s) and {r['relay_failovers']} relay(s) "
            "failed over" if r.get("sim_failovers") or r.get("relay_failovers") else ""))
        if done else f"incomplete at {r.get('phase')}: {r.get('error', '?')}",
    ]
    return "| " + " | ".join(map(str, cols)) + " |"


HEAD = ("N", "fan-out / controller's connections", "storm s",
        "storm CPU s: ctl / each relay / all simulated agents",
        "rank-0 step ms without / with", "ratio", "ctl CPU % of a core", "ctl RSS MiB",
        "ctl fds", "hung rank seen s", "-> all locked ms", "-> all save orders ms",
        "-> verdict ms", "-> all exit orders ms", "flow CPU s: ctl / each relay / all "
        "simulated agents (to the verdict and after)", "bytes per rank per flow",
        "outcome")


def run_size(n: int, args: argparse.Namespace) -> Dict[str, Any]:
    why = can_run(n)
    if why:
        return {"n": n, "skip": why}
    cmd = [sys.executable, __file__, "--one", str(n), "--window", str(args.window)] + \
        (["--hogs"] if args.hogs else [])
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, timeout=args.timeout,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        lines = [ln for ln in p.stdout.decode().splitlines() if ln.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        return {"n": n, "phase": "start", "error": f"exit status {p.returncode}"}
    except subprocess.TimeoutExpired:
        return {"n": n, "phase": "?", "error": f"killed after {args.timeout} s"}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536, 100000])
    ap.add_argument("--window", type=float, default=40.0,
                    help="seconds of rank-0 training with the control plane (and as much without)")
    ap.add_argument("--hogs", action="store_true", help="measure false faults under load")
    ap.add_argument("--timeout", type=float, default=1790.0, help="per size, seconds")
    ap.add_argument("--heartbeat-timeout", type=float, default=None,
                    help="TTP_HEARTBEAT_TIMEOUT for every tier (default: the default, 6 s); for "
                    "a machine too loaded for thousands of simulated nodes to beat in time")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.heartbeat_timeout:
        os.environ["BENCH_HEARTBEAT_TIMEOUT"] = f"{a.heartbeat_timeout:g}"
    if a.one:
        out: Dict[str, Any] = {"n": a.one, "phase": "start",
                               "load_start": os.getloadavg()[0]}
        try:
            if a.hogs:
                hogs(a.one, a.window, out)
            else:
                run_one(a.one, a.window, out)
        except Exception as exc:  # noqa: BLE001 - an incomplete flow is a row, not a crash
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["load_end"] = os.getloadavg()[0]
        print(json.dumps(out), flush=True)
        os._exit(0)  # daemon helpers and the runtime's threads: nothing left to wait for
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load "
          f"average {open('/proc/loadavg').read().strip()}; layout TP {TP} x PP 4 (100,000: 5), "
          f"{PER_NODE} ranks a node; defaults for each size", flush=True)
    results = []
    for n in a.sizes:
        t0 = time.monotonic()
        r = run_size(n, a)
        results.append(r)
        print(f"# {n}: {time.monotonic() - t0:.0f} s, load average at start/end "
              f"{fmt(r.get('load_start'), '.1f')}/{fmt(r.get('load_end'), '.1f')}", flush=True)
        if a.hogs:
            for h in r.get("hog_rows", []):
                print(f"{n} ranks, heartbeat {r['interval']:g} s / timeout {r['timeout']:g} s, "
                      f"{h['load']}: {h['faults']} false fault(s), {h['failovers']} false "
                      f"failover(s) in {h['heartbeats']} rank heartbeats {h['first']}",
                      flush=True)
            if "hog_rows" not in r:
                print(row(r), flush=True)
        else:
            print(row(r), flush=True)
    if not a.hogs:
        print("| " + " | ".join(HEAD) + " |")
        print("|" + "---|" * len(HEAD))
        for r in results:
            print(row(r))
    print(f"# load average at the end {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
