"""ttprun against small worker scripts that play the runtime's part of the contract (write
``$TTP_RUN_DIR/flow-finished.json``, then exit non-zero), so the launcher's grace period is tested
on its own: survivors are not killed at once, the wait ends early when the flow has finished,
stragglers and stopped workers are killed, and SIGTERM to the launcher is forwarded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mindio_ttp.launch.agent import DEFAULT_OT_S, build_parser, overtime_s

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    run_dir = Path(os.environ["TTP_RUN_DIR"])
    (out / f"env-{rank}").write_text(os.environ["TTP_RUN_DIR"] + "\\n" + os.environ["TTP_AUTH_KEY"])
    # what ttp_start_processor marks: this attempt has a runtime worth holding for TTP_OT
    (run_dir / "runtime-started").mkdir(exist_ok=True)
    (run_dir / "runtime-started" / f"rank-{rank}").touch()

    def finish_flow(code=2):
        if rank == 0:
            tmp = run_dir / "flow-finished.json.tmp"
            outcome = "no_consistent_step" if mode == "nostep" else "saved"
            flow = {"outcome": outcome, "step": 3, "ranks": [0, 2, 3], "exit_code": code,
                    "reason": "scripted", "rank": rank, "time": time.time()}
            tmp.write_text(json.dumps(flow))
            os.replace(tmp, run_dir / "flow-finished.json")
        os._exit(code)

    def on_term(signum, frame):
        (out / f"term-{rank}").write_text("x")
        if mode != "preempt":
            os._exit(143)
        time.sleep(0.5)
        (out / f"saved-{rank}").write_text("x")
        finish_flow()

    signal.signal(signal.SIGTERM, on_term)
    if mode == "restart" and os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        (out / f"restarted-{rank}").write_text(os.environ["TTP_RUN_DIR"])
        os._exit(0)
    (out / f"started-{rank}").write_text("x")
    if mode == "preempt":
        while True:
            time.sleep(0.05)
    if mode == "plain" and rank != 1:
        os._exit(0)
    if mode == "complete":  # what ttp_job_complete writes past the final save's barrier
        tmp = run_dir / f"job-complete.json.{rank}.tmp"
        tmp.write_text(json.dumps({"step": 10, "rank": rank, "checkpoint": "", "time": 0}))
        os.replace(tmp, run_dir / "job-complete.json")
        time.sleep(0.3)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        os._exit(1 if rank == 2 else 0)  # rank 2: its last collective failed on rank 1
    if rank == 1:
        time.sleep(0.3)
        if mode == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(3)
    if mode == "hang":
        while True:
            time.sleep(0.05)
    if mode == "ok":
        os._exit(0)
    time.sleep(1.5)  # the dying checkpoint: stock torchrun would have killed us by now
    (out / f"saved-{rank}").write_text("x")
    finish_flow()
    """
)


def _launch(
    tmp_path: Path, mode: str, port: int, ot: str = "30", extra_args: tuple = (), **env_extra: str
):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, TTP_OT=ot, TTP_RUN_DIR=str(tmp_path / "runs"), **env_extra)
    env.pop("TTP_AUTH_KEY", None)
    cmd = [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", "--nproc-per-node=4",
        "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
        "--node-rank=0", "--monitor-interval=0.05", *extra_args, str(script), mode, str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, out


def _finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"ttprun did not exit within {timeout} s:\n{output}")
    return output


def test_help_lists_torchrun_options() -> None:
    text = build_parser().format_help()
    assert text.startswith("usage: ttprun")
    for option in ("--nproc-per-node", "--max-restarts", "--rdzv-backend", "--monitor-interval"):
        assert option in text


def test_overtime_parses_env_and_refuses_garbage() -> None:
    assert overtime_s({}) == DEFAULT_OT_S
    assert overtime_s({"TTP_OT": "7.5"}) == 7.5
    with pytest.raises(ValueError, match="TTP_OT='soon' is not a number"):
        overtime_s({"TTP_OT": "soon"})
    for bad in ("-1", "0", "nan", "inf", "1e9"):
        with pytest.raises(ValueError, match=f"TTP_OT='{bad}' must be a positive number"):
            overtime_s({"TTP_OT": bad})


@pytest.mark.slow
def test_survivors_finish_the_flow_and_launcher_exits_early(tmp_path: Path, free_port: int) -> None:
    start = time.monotonic()
    proc, out = _launch(tmp_path, "crash", free_port)
    output = _finish(proc)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, output
    # the survivors were allowed to finish their 1.5 s "save" (stock torchrun SIGTERMs at once)
    assert sorted(p.name for p in out.glob("saved-*")) == ["saved-0", "saved-2", "saved-3"], output
    assert not list(out.glob("term-*")), "survivors got SIGTERM during the grace period"
    assert "dying-checkpoint flow finished" in output
    assert elapsed < 20, f"launcher waited {elapsed:.1f} s although the flow finished"
    tail = output.strip().splitlines()[-3:]
    assert tail[0].startswith("ttprun: rank 1 (node "), output
    assert "exited with code 3" in tail[0] and "rank 0" not in tail[0], output
    assert "dying checkpoint of iteration 3 saved and marked latest" in tail[1], output
    # not Megatron's --save/--load: ttprun cannot tell how this script resumes, and says so
    assert tail[2] == ("ttprun: exit 1 so your scheduler restarts the job; resume from "
                       "iteration 3 (the checkpoint directory) if your script loads it; ttprun "
                       "cannot tell from its arguments"), output
    assert "Root Cause" not in output, "torch's table would name the saving ranks as failures"
    envs = {p.read_text() for p in out.glob("env-*")}
    assert len(envs) == 1, "all workers must see the same TTP_RUN_DIR and TTP_AUTH_KEY"
    run_dir, key = envs.pop().split("\n")
    assert Path(run_dir).parent == tmp_path / "runs"
    assert len(key) == 64 and int(key, 16) >= 0
    assert (Path(run_dir) / "flow-finished.json").is_file()


@pytest.mark.slow
def test_stragglers_are_killed_when_overtime_runs_out(tmp_path: Path, free_port: int) -> None:
    start = time.monotonic()
    proc, out = _launch(tmp_path, "hang", free_port, ot="2")
    output = _finish(proc)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, output
    assert "TTP_OT (2 s) ran out" in output
    assert 2 <= elapsed < 20, elapsed


@pytest.mark.slow
def test_stopped_worker_is_killed_once_flow_finished(tmp_path: Path, free_port: int) -> None:
    start = time.monotonic()
    proc, out = _launch(tmp_path, "stopped", free_port, ot="60")
    # rank 1 is stopped, so the launcher sees no failure until the survivors exit after the flow
    output = _finish(proc)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, output
    assert "killing stopped worker 1" in output
    assert elapsed < 30, f"a stopped worker held the launcher for {elapsed:.1f} s"


@pytest.mark.slow
def test_sigterm_to_launcher_is_forwarded_with_grace(tmp_path: Path, free_port: int) -> None:
    proc, out = _launch(tmp_path, "preempt", free_port, ot="60",
                        extra_args=(f"--outcome-file={tmp_path / 'outcome.json'}",))
    deadline = time.monotonic() + 30
    while len(list(out.glob("started-*"))) < 4:
        assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
        time.sleep(0.05)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert len(list(out.glob("term-*"))) == 4, output
    assert len(list(out.glob("saved-*"))) == 4, "workers were killed before their 0.5 s save"
    assert time.monotonic() - start < 20
    # the same plain closing lines as after a kill (it ended with the record's raw JSON)
    tail = output.strip().splitlines()[-3:]
    assert tail[0] == "ttprun: ttprun got SIGTERM (preemption)", output
    assert tail[1].startswith("ttprun: dying checkpoint of iteration 3 saved"), output
    assert tail[2].startswith("ttprun: exit 143 (SIGTERM); "), output
    assert '{"outcome"' not in output, output
    doc = json.loads((tmp_path / "outcome.json").read_text())
    assert (doc["outcome"], doc["exit_code"], doc["preempted"], doc["iteration"]) == \
        ("saved", 143, True, 3), doc
    assert doc["lines"] == [line[len("ttprun: "):] for line in tail]


@pytest.mark.slow
def test_clean_run_exits_zero_and_removes_its_run_dir(tmp_path: Path, free_port: int) -> None:
    script = tmp_path / "ok.py"
    script.write_text("import os, pathlib; pathlib.Path(os.environ['TTP_RUN_DIR'], 'seen').touch()")
    env = {k: v for k, v in os.environ.items() if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY")}
    cmd = [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", "--nproc-per-node=2",
        "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port}",
        "--node-rank=0", f"--outcome-file={tmp_path / 'outcome.json'}", str(script),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-3:] == [
        "ttprun: every worker succeeded", "ttprun: no fault", "ttprun: exit 0"], done.stderr
    doc = json.loads((tmp_path / "outcome.json").read_text())
    assert (doc["outcome"], doc["exit_code"], doc["failed_ranks"]) == ("succeeded", 0, [])


def test_a_worker_lost_after_the_job_completed_fails_nothing(tmp_path: Path,
                                                            free_port: int) -> None:
    """Issue 23: once a worker wrote job-complete.json (the final checkpoint complete on every
    rank), a worker killed afterwards, and one whose last collective then failed, are no
    failure: the job succeeds, at once, not after TTP_OT."""
    start = time.monotonic()
    proc, _ = _launch(tmp_path, "complete", free_port)
    output = _finish(proc)
    assert proc.returncode == 0, output
    assert "failed after the job's final checkpoint was complete on every rank" in output
    assert time.monotonic() - start < 25, output


def test_multi_node_start_without_a_key_is_refused(tmp_path: Path, free_port: int) -> None:
    """ttprun never sends a key over the network: across nodes the user or scheduler gives it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY", "TTP_AUTH_KEY_FILE")}
    cmd = [sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port}",
           str(tmp_path / "never_started.py")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "multi-node job needs a control-plane key" in done.stderr
    assert "TTP_AUTH_KEY_FILE" in done.stderr
    # the insecure opt-in is for one machine: each node would make up another key
    done = subprocess.run(cmd, env=dict(env, TTP_INSECURE_NO_AUTH="1"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "multi-node job needs a control-plane key" in done.stderr
    # a key file others can read is no secret on a shared cluster: refused before any start
    key_file = tmp_path / "ttp.key"
    key_file.write_text("ab" * 32 + "\n")
    key_file.chmod(0o644)
    done = subprocess.run(cmd, env=dict(env, TTP_AUTH_KEY_FILE=str(key_file)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"chmod 600 {key_file}" in done.stderr, done.stderr


@pytest.mark.slow
def test_two_nodes_use_the_given_key_and_none_is_in_the_store(tmp_path: Path,
                                                              free_port: int) -> None:
    from torch.distributed import TCPStore

    if not hasattr(TCPStore, "list_keys"):  # torch 2.1 has no way to list a store's keys
        pytest.skip("this torch's TCPStore cannot list its keys")
    script = tmp_path / "key.py"
    # What an outsider does: a plain TCPStore client at the rendezvous endpoint and at
    # MASTER_PORT lists every key and reads every value (the first ttprun put the key there).
    script.write_text(textwrap.dedent("""
        import datetime, json, os, pathlib
        from torch.distributed import TCPStore
        key = os.environ['TTP_AUTH_KEY']
        seen, leaked = 0, []
        for port in sorted({int(os.environ['RDZV_PORT']), int(os.environ['MASTER_PORT'])}):
            store = TCPStore('127.0.0.1', port, is_master=False,
                             timeout=datetime.timedelta(seconds=10))
            for name in store.list_keys():
                value = store.get(name)
                seen += 1
                if (key.lower().encode() in value.lower() or bytes.fromhex(key) in value
                        or key.lower() in name.lower()):
                    leaked.append(name)
        pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(
            json.dumps({'key': key, 'seen': seen, 'leaked': leaked}))
    """))
    key = os.urandom(32).hex()
    env = {k: v for k, v in os.environ.items() if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY_FILE")}
    env.update(OUT=str(tmp_path), TTP_AUTH_KEY=key, RDZV_PORT=str(free_port))
    cmd = [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port}", "--rdzv-id=keytest",
        "--monitor-interval=0.05", str(script),
    ]  # fmt: skip
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]  # fmt: skip
    outputs = [_finish(node) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    found = [json.loads((tmp_path / r).read_text()) for r in ("0", "1")]
    assert [f["key"] for f in found] == [key, key]  # the given key, on both nodes
    assert all(f["seen"] > 0 for f in found), found  # the outsider did read the stores
    assert [f["leaked"] for f in found] == [[], []], found


@pytest.mark.slow
def test_max_restarts_restarts_after_the_grace_with_the_marker_moved_aside(
    tmp_path: Path, free_port: int
) -> None:
    proc, out = _launch(tmp_path, "restart", free_port, extra_args=["--max-restarts=1"])
    output = _finish(proc)
    assert proc.returncode == 0, output
    # the first attempt's survivors were not cut short, then all four restarted
    assert len(list(out.glob("saved-*"))) == 3 and len(list(out.glob("restarted-*"))) == 4
    run_dir = Path((out / "restarted-0").read_text())
    assert (run_dir / "flow-finished.attempt1.json").is_file()
    assert not (run_dir / "flow-finished.json").exists()


@pytest.mark.slow
def test_outcome_no_consistent_step_is_said_in_words(tmp_path: Path, free_port: int) -> None:
    proc, _ = _launch(tmp_path, "nostep", free_port)
    output = _finish(proc)
    assert proc.returncode == 1, output
    tail = output.strip().splitlines()[-3:]
    assert tail[0].startswith("ttprun: rank 1 (node "), output
    assert "no iteration had a clean copy of every shard, so nothing was saved" in tail[1], output


@pytest.mark.slow
def test_plain_failure_keeps_torchs_table_and_says_no_flow_ran(
    tmp_path: Path, free_port: int
) -> None:
    proc, _ = _launch(tmp_path, "plain", free_port)
    output = _finish(proc)
    assert proc.returncode == 1, output
    assert "Root Cause" in output
    tail = output.strip().splitlines()[-3:]
    assert tail[0].startswith("ttprun: rank 1 (node ") and "code 3" in tail[0], output
    assert tail[1].startswith("ttprun: no dying-checkpoint flow ran, nothing was saved"), output
    assert tail[2] == "ttprun: exit 1", output


ENV_PROBE = (
    "import json, os, pathlib, sys\n"
    "names = ('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'NCCL_ASYNC_ERROR_HANDLING',\n"
    "         'HCCL_ASYNC_ERROR_HANDLING')\n"
    "pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(\n"
    "    json.dumps({n: os.environ.get(n) for n in names}))\n"
)


def _probe_env(tmp_path: Path, port: int, script_args: tuple = (), **env_extra: str):
    script = tmp_path / "probe.py"
    script.write_text(ENV_PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                        "NCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING")}
    env.update(OUT=str(tmp_path), **env_extra)
    cmd = [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", "--nproc-per-node=2",
        "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
        "--node-rank=0", str(script), *script_args,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads((tmp_path / r).read_text()) for r in ("0", "1")], done.stderr


def test_workers_get_the_collective_settings_a_dying_checkpoint_needs(
    tmp_path: Path, free_port: int
) -> None:
    """torch's NCCL default (3) kills survivors of a hung collective; torch_npu's HCCL default
    (1) terminates them on a dead peer's error: ttprun's workers get 2 and 0, under both of
    NCCL's names (torch 2.1 reads only the old one, which torch's agent sets to 1: D4)."""
    seen, err = _probe_env(tmp_path, free_port)
    assert seen == [{"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "2",
                     "HCCL_ASYNC_ERROR_HANDLING": "0"}] * 2
    assert "warning" not in err
    assert "ttprun: recovery mode: in memory (no GPU or NPU here: gloo" in err, err


def test_a_users_collective_setting_wins(tmp_path: Path, free_port: int) -> None:
    seen, err = _probe_env(tmp_path, free_port, TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
                           NCCL_ASYNC_ERROR_HANDLING="3")
    assert {s["TORCH_NCCL_ASYNC_ERROR_HANDLING"] for s in seen} == {"1"}
    assert {s["NCCL_ASYNC_ERROR_HANDLING"] for s in seen} == {"3"}
    assert {s["HCCL_ASYNC_ERROR_HANDLING"] for s in seen} == {"0"}
    assert "warning: your NCCL_ASYNC_ERROR_HANDLING=3 (the name torch 2.1 reads" in err, err


def test_megatron_timeout_shorter_than_the_grace_is_warned(tmp_path: Path, free_port: int) -> None:
    """A script outside any Megatron tree: the flag on its command line is all there is."""
    _, err = _probe_env(tmp_path, free_port, ("--distributed-timeout-minutes", "1"), TTP_OT="300")
    assert "ttprun: warning: the workers' process-group timeout (60 s, " \
           "--distributed-timeout-minutes 1) ends before TTP_OT (300 s)" in err, err
    assert "pass --distributed-timeout-minutes 10 or more, or lower TTP_OT to at most 0 s" in err
    _, err = _probe_env(tmp_path, free_port, ("--distributed-timeout-minutes=10",), TTP_OT="300")
    assert "warning" not in err, err


GLOO_WORKER = textwrap.dedent(
    """
    import datetime, os, pathlib, sys
    import torch
    import torch.distributed as dist

    out = pathlib.Path(sys.argv[1])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    (out / f"port-attempt{attempt}-rank{rank}").write_text(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    t = torch.ones(1)
    dist.all_reduce(t)
    (out / f"attempt{attempt}-rank{rank}").write_text(str(t.item()))
    if attempt < int(os.environ["FAIL_ATTEMPTS"]):
        if rank == 1:
            os._exit(3)
        dist.barrier()  # hangs on the dead rank until the launcher stops this attempt
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("store_ports", ["", "one"])
def test_each_restart_attempt_gets_its_own_store(tmp_path: Path, free_port: int,
                                                 store_ports: str) -> None:
    """torch 2.13's static rendezvous keeps one store for every attempt, so a restarted attempt
    read attempt 0's addresses ("Gloo connectFullMesh failed"); ttprun gives each its own.
    TTP_RESTART_STORE_PORTS of one port (a strict firewall): every restart's store is there,
    a fresh one each time (the previous attempt's is closed first)."""
    script = tmp_path / "gloo_worker.py"
    script.write_text(GLOO_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY")}
    env.update(FAIL_ATTEMPTS="2", TTP_OT="30")
    fixed = None
    if store_ports:
        from mindio_ttp.demo.rehearsal.launch import pick_free_port

        fixed = pick_free_port()
        env["TTP_RESTART_STORE_PORTS"] = str(fixed)
    cmd = [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", "--nproc-per-node=3",
        "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port}",
        "--node-rank=0", "--max-restarts=2", "--monitor-interval=0.05", str(script), str(tmp_path),
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-4000:]
    for attempt in range(3):
        assert [(tmp_path / f"attempt{attempt}-rank{r}").read_text() for r in range(3)] == \
            ["3.0"] * 3, (attempt, done.stderr[-4000:])
        ports = {(tmp_path / f"port-attempt{attempt}-rank{r}").read_text() for r in range(3)}
        assert len(ports) == 1, ports
        if attempt == 0:
            assert ports == {str(free_port)}
        elif fixed is not None:
            assert ports == {str(fixed)}, (attempt, ports)
    # no TTP runtime ran in these workers, so no attempt was held for TTP_OT
    assert done.stderr.count("no TTP runtime started") == 2, done.stderr[-4000:]
    assert "keeping survivors up to" not in done.stderr
    print(f"3 attempts, 2 failures, no hold: {elapsed:.1f} s")


NODE_WORKER = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    out, node = pathlib.Path(sys.argv[1]), os.environ["NODE"]
    run_dir = pathlib.Path(os.environ["TTP_RUN_DIR"])
    (run_dir / "runtime-started").mkdir(exist_ok=True)
    (run_dir / "runtime-started" / f"rank-{os.environ['RANK']}").touch()
    (out / f"up-{node}").write_text(str(os.getpid()))
    if node == "A":
        time.sleep(600)  # killed with its whole node
    deadline = time.monotonic() + 60
    while not (out / "node-A-lost").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # the dying checkpoint: torch's agent would have stopped us by now
    (out / "saved-B").write_text("x")
    tmp = run_dir / "flow.tmp"
    tmp.write_text(json.dumps({"outcome": "saved", "step": 3, "ranks": [int(os.environ["RANK"])],
                               "exit_code": 83, "reason": "scripted",
                               "rank": int(os.environ["RANK"]), "time": time.time()}))
    os.replace(tmp, run_dir / "flow-finished.json")
    os._exit(83)
    """
)


def _node_cmd(script: Path, out: Path, port: int, notice: str = "10") -> list:
    return [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nodeloss",
        "--monitor-interval=0.05", str(script), str(out),
    ]  # fmt: skip


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    pytest.fail(f"the first agent never listened on {port}")


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(10)


@pytest.mark.slow
def test_losing_the_node_that_hosts_the_store_keeps_the_other_nodes_workers(
    tmp_path: Path, free_port: int
) -> None:
    """c10d: node A hosts the rendezvous store; when A is lost, torch's agent on B got a
    RendezvousConnectionError in its monitor loop and stopped B's workers before they saved."""
    script = tmp_path / "node.py"
    script.write_text(NODE_WORKER)
    base = {k: v for k, v in os.environ.items() if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY_FILE")}
    base.update(TTP_AUTH_KEY=os.urandom(32).hex(), TTP_OT="30")
    cmd = _node_cmd(script, tmp_path, free_port)
    a = subprocess.Popen(cmd, env=dict(base, NODE="A"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    b = None
    try:
        _wait_listening(free_port, a)
        b = subprocess.Popen(cmd, env=dict(base, NODE="B"), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"up-{n}").exists() for n in "AB"):
            assert time.monotonic() < deadline and b.poll() is None and a.poll() is None
            time.sleep(0.05)
        _kill_tree(a)  # node A: its agent (the store) and its worker, at once
        (tmp_path / "node-A-lost").touch()
        output = _finish(b, timeout=90)
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                _kill_tree(proc)
    assert (tmp_path / "saved-B").exists(), output
    assert "ttprun: lost the rendezvous store" in output, output
    assert "dying checkpoint of iteration 3 saved" in output, output
    assert b.returncode == 1, output


def test_a_node_waiting_for_absent_peers_says_what_it_waits_for(
    tmp_path: Path, free_port: int
) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never started: the other node never came')")
    env = {k: v for k, v in os.environ.items() if k not in ("TTP_RUN_DIR", "TTP_AUTH_KEY_FILE")}
    env.update(TTP_AUTH_KEY=os.urandom(32).hex(), TTPRUN_RDZV_NOTICE_S="0.3")
    proc = subprocess.Popen(_node_cmd(script, tmp_path, free_port), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "ttprun: waited" in line or time.monotonic() > deadline:
                break
    finally:
        _kill_tree(proc)
    line = next((s for s in seen if "ttprun: waited" in s), None)
    assert line is not None, "".join(seen)
    assert "'nodeloss'" in line and "c10d rendezvous" in line
    assert "join_timeout" in line and "--rdzv-id" in line
