"""One controller against many simulated processors on loopback (real protocol, real sockets).

For each processor count N: a controller process (the real `Controller`, one selector
thread) and a few client processes, each running N/k asyncio clients that register,
heartbeat every TTP_HEARTBEAT_INTERVAL and answer lock/advance/save/rename orders at once.
Measured: registration time, the controller's CPU % under heartbeat load (psutil, over a
window of several intervals), latency from one client's disconnect to the controller noticing
it and to its step decision, and the time to dispatch save orders (decision -> last client
receiving its order). Layout: DP groups of 8 with 4 shards, so N/2 ranks save.

    python bench/bench_controller_scale.py                 # 64, 512, 4096
    python bench/bench_controller_scale.py --sizes 64 512 --window 6
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import random
import resource
import sys
import time
from typing import Dict, List

import psutil

from mindio_ttp.config import TTPConfig
from mindio_ttp.control import protocol as P
from mindio_ttp.control.controller import Controller
from mindio_ttp.control.session import RankHandshake

KEY = os.urandom(32)
DP, REPLICA = 8, 4


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        sys.exit(f"need {need} file descriptors, `ulimit -n` allows {soft}: raise it")


def env(interval: float) -> Dict[str, str]:
    return {"TTP_AUTH_KEY": KEY.hex(), "TTP_HEARTBEAT_INTERVAL": str(interval),
            "TTP_HEARTBEAT_TIMEOUT": str(3 * interval), "TTP_OT": "600",
            "TTP_SAVE_TIME_LIMIT": "60"}


def controller_proc(n: int, interval: float, q: mp.Queue, done: mp.Event) -> None:
    raise_fd_limit(n + 256)
    ctl = Controller(TTPConfig.from_env(env(interval)), n, REPLICA, host_rank=0)
    ctl.listen("127.0.0.1", 0)
    ctl.start()
    q.put(("port", ctl.address[1]))
    while len(ctl.registered) < n:
        time.sleep(0.02)
    q.put(("registered", time.monotonic()))
    ctl.decided.wait(600)
    d = ctl.decision
    q.put(("timeline", dict(ctl.timeline), d.outcome.value if d else None,
           len(d.ranks) if d else 0))
    done.wait(60)
    ctl.stop()


async def one_client(rank: int, n: int, port: int, interval: float, stats: dict,
                     victim: bool, kill: mp.Event) -> None:
    group = rank // DP * DP
    dp_ranks = list(range(group, group + DP))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    hs = RankHandshake(KEY)  # the processor's handshake, over asyncio streams
    challenge: List[P.Message] = []
    while not challenge:
        data = await reader.read(65536)
        if not data:
            return
        challenge = hs.dec.feed(data)
    writer.write(hs.answer(challenge[0], P.Register(rank, n, dp_ranks, REPLICA, "127.0.0.1", 0,
                                                    os.getpid(), 10, False, False, False)))
    send = lambda m: writer.write(hs.tx.seal(m))  # noqa: E731
    dec = hs.dec

    async def beat() -> None:
        await asyncio.sleep(random.random() * interval)
        seq = 0
        while True:
            seq += 1
            send(P.Heartbeat(rank, seq, 10, False))
            await asyncio.sleep(interval)

    async def killer() -> None:
        while not kill.is_set():
            await asyncio.sleep(0.005)
        stats["killed_at"] = time.monotonic()
        writer.transport.abort()

    tasks = [asyncio.create_task(beat())]
    if victim:
        tasks.append(asyncio.create_task(killer()))
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            for m in dec.feed(data):
                if isinstance(m, P.Lock):
                    send(P.StateReport(m.flow_id, 1, rank, 10, False))
                elif isinstance(m, P.AdvanceTo):
                    send(P.StateReport(m.flow_id, 2, rank, 10, False))
                elif isinstance(m, P.SaveOrder):
                    stats["save_rx"] = max(stats.get("save_rx", 0.0), time.monotonic())
                    stats["saves"] = stats.get("saves", 0) + 1
                    send(P.SaveResult(m.flow_id, rank, True, "", 0.0))
                elif isinstance(m, P.RenameOrder):
                    send(P.RenameResult(m.flow_id, rank, True, "", 0.0))
                elif isinstance(m, P.ExitOrder):
                    stats["exits"] = stats.get("exits", 0) + 1
                    return
    except (ConnectionError, OSError):
        pass
    finally:
        for t in tasks:
            t.cancel()
        writer.close()


def client_proc(ranks: List[int], n: int, port: int, interval: float, victim: int,
                kill: mp.Event, q: mp.Queue) -> None:
    raise_fd_limit(len(ranks) + 256)
    stats: dict = {}

    async def main() -> None:
        tasks = []
        for i, r in enumerate(ranks):
            tasks.append(asyncio.create_task(one_client(r, n, port, interval, stats, r == victim,
                                                        kill)))
            if i % 64 == 63:
                await asyncio.sleep(0)  # let the listener's backlog drain
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    q.put(("client", stats))


def run(n: int, procs: int, interval: float, window: float) -> dict:
    ctx = mp.get_context("fork")
    q, done, kill = ctx.Queue(), ctx.Event(), ctx.Event()
    ctl = ctx.Process(target=controller_proc, args=(n, interval, q, done))
    ctl.start()
    port = q.get(timeout=30)[1]
    t0 = time.monotonic()
    victim = n - 1
    chunks = [list(range(i, n, procs)) for i in range(procs)]
    clients = [ctx.Process(target=client_proc, args=(c, n, port, interval, victim, kill, q))
               for c in chunks]
    for c in clients:
        c.start()
    kind, registered_at = q.get(timeout=120)
    assert kind == "registered"
    reg_time = registered_at - t0
    time.sleep(interval)  # heartbeats reach their steady phase spread
    ps = psutil.Process(ctl.pid)
    c0, w0 = sum(ps.cpu_times()[:2]), time.monotonic()
    time.sleep(window)
    c1 = sum(ps.cpu_times()[:2])
    cpu = (c1 - c0) / (time.monotonic() - w0) * 100
    kill.set()
    timeline = None
    client_stats = []
    while timeline is None or len(client_stats) < procs:
        item = q.get(timeout=300)
        if item[0] == "timeline":
            timeline, outcome, n_savers = item[1], item[2], item[3]
            flow_cpu = sum(ps.cpu_times()[:2]) - c1
        elif item[0] == "client":
            client_stats.append(item[1])
    done.set()
    for p in clients + [ctl]:
        p.join(30)
        if p.is_alive():
            p.kill()
    killed_at = next(s["killed_at"] for s in client_stats if "killed_at" in s)
    save_rx = max(s.get("save_rx", 0.0) for s in client_stats)
    return {
        "n": n, "register_s": reg_time, "cpu_pct": cpu,
        "detect_ms": (timeline["fault"] - killed_at) * 1e3,
        "decide_ms": (timeline["chosen"] - killed_at) * 1e3,
        "flow_cpu_ms": flow_cpu * 1e3,
        "phase1_ms": (timeline["locked"] - timeline["fault"]) * 1e3,
        "dispatch_ms": (save_rx - timeline["chosen"]) * 1e3,
        "exit_ms": (timeline["exit_sent"] - killed_at) * 1e3,
        "savers": n_savers, "saves_rx": sum(s.get("saves", 0) for s in client_stats),
        "exits_rx": sum(s.get("exits", 0) for s in client_stats), "outcome": outcome,
        "hb_per_s": (n - 1) / interval,
    }


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 4096])
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--interval", type=float, default=2.0, help="heartbeat interval, s")
    ap.add_argument("--window", type=float, default=10.0, help="CPU measuring window, s")
    ap.add_argument("--verbose", action="store_true", help="show the controller's log")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.CRITICAL)
    raise_fd_limit(max(a.sizes) + 256)
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, heartbeat "
          f"{a.interval:g} s, {a.procs} client processes, DP groups of {DP} with {REPLICA} "
          f"shards", flush=True)
    head = ("N", "hb/s", "register s", "ctl CPU %", "detect ms", "lock ms", "decide ms",
            "dispatch ms", "exit ms", "ctl CPU ms in flow", "savers", "outcome")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n in a.sizes:
        r = run(n, a.procs, a.interval, a.window)
        assert r["saves_rx"] == r["savers"], r
        cols = [n, f"{r['hb_per_s']:.0f}", f"{r['register_s']:.2f}", f"{r['cpu_pct']:.1f}",
                f"{r['detect_ms']:.1f}", f"{r['phase1_ms']:.1f}", f"{r['decide_ms']:.1f}",
                f"{r['dispatch_ms']:.1f}", f"{r['exit_ms']:.1f}", f"{r['flow_cpu_ms']:.0f}",
                r["savers"], r["outcome"]]
        print("| " + " | ".join(map(str, cols)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
