"""`ttp-demo --megatron DIR` end to end on the real Megatron-LM 285068c (TTP_MEGATRON_DIR): in
each recovery mode its stages (five in memory, the default; six with the dying checkpoint),
MATCH, exit 0, and without --keep nothing left behind that the output does not
say it keeps. The demo runs as the user runs it, a subprocess with its own TMPDIR, so anything it
(or ttprun, torch elastic, the CPU adaptor's helper build) writes to the temp dir is seen.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron]

DEMO_TIMEOUT_S = 600  # about a minute on two cores; three training runs of ~20 s each
STAGES = [
    r"\[1/6\] copying .* \(git clone --shared: your checkout is only read\) and patching the "
    r"copy: ttp-patch apply --device cpu --allow-modified \.\.\.",
    r"\[2/6\] generating a small dataset in .*",
    r"\[3/6\] training on 4 CPU ranks under ttprun \(10 iterations, .*\); SIGKILL to rank 1 "
    r"once iteration 4 is logged \.\.\.",
    r"\[4/6\] the dying checkpoint \.\.\.",
    r"\[5/6\] resuming: the same command again; Megatron loads iteration \d+ from .*",
    r"\[6/6\] the uninterrupted reference run \(10 iterations, .*\) and the comparison \.\.\.",
]


def _run_demo(args, tmpdir: Path, timeout: float = DEMO_TIMEOUT_S):
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), COLUMNS="1000")  # whole lines, to match them
    env.pop("TTP_CPU_BUILD_DIR", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mindio_ttp.demo", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    return done, time.monotonic() - start


def _stages_in_order(out: str, stages) -> None:
    """Each stage line exactly once, in order."""
    lines = out.splitlines()
    positions = []
    for stage in stages:
        found = [i for i, line in enumerate(lines) if re.fullmatch(stage, line)]
        assert len(found) == 1, f"stage line {stage!r} missing or repeated:\n{out}"
        positions += found
    assert positions == sorted(positions), "stages out of order"


def _modified_clone(megatron_dir: Path, dest: Path) -> Path:
    """A clone at 285068c whose training.py has an uncommitted edit of the user's: a tree
    ttp-patch takes only with --allow-modified, and only as it is in the work tree."""
    from mindio_ttp.demo.rehearsal.tree import copy_megatron_tree

    src = copy_megatron_tree(megatron_dir, dest)
    training = src / "megatron/training.py"
    training.write_text(training.read_text() + "\n# a local change of the user's\n")
    return src


def test_demo_megatron_refuses_a_modified_tree_with_ttp_patchs_words(megatron_dir: Path,
                                                                     tmp_path: Path) -> None:
    src = _modified_clone(megatron_dir, tmp_path / "src")
    done, _ = _run_demo(["--megatron", str(src)], tmp_path / "tmp", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "has uncommitted changes; the copy takes them too" in done.stdout
    assert "megatron/training.py" in done.stdout and "--allow-modified" in done.stdout
    assert "RESULT: REFUSED" in done.stdout
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_demo_megatron_kills_resumes_and_matches_leaving_nothing(megatron_dir: Path,
                                                                 tmp_path: Path) -> None:
    """On a tree with an uncommitted edit, taken as it is with --allow-modified (the plain
    285068c tree takes the same path without the flag)."""
    tmpdir = tmp_path / "tmp"
    src = _modified_clone(megatron_dir, tmp_path / "src")
    done, elapsed = _run_demo(["--megatron", str(src), "--allow-modified",
                               "--recovery", "dying-checkpoint"], tmpdir)
    out = done.stdout
    print(out)
    print(f"ttp-demo --megatron took {elapsed:.1f} s")
    assert done.returncode == 0, out + done.stderr
    _stages_in_order(out, STAGES)

    shown = re.search(r"^      iteration (\d+) in (\S+)/ckpt/iter_(\d{7}), marked latest "
                      r"\(latest_checkpointed_iteration\.txt says (\d+)\)$", out, re.M)
    assert shown, out
    step, work = int(shown.group(1)), Path(shown.group(2))
    assert int(shown.group(3)) == step == int(shown.group(4))
    assert 4 <= step < 10, "killed after iteration 4 was logged, before the end"
    assert (f"    | ttprun: dying checkpoint of iteration {step} saved in "
            f"{work}/ckpt/iter_{step:07d} and marked latest") in out
    assert "    | ttprun: rank 1 (node " in out and "was killed by SIGKILL" in out
    assert f"Megatron loads iteration {step} from {work}/ckpt" in out
    assert f"iterations {step + 1}-10" in out
    # the kill lands from outside wherever rank 1 is: when the survivors finished iteration
    # `step` but its line was never printed (Megatron prints after a barrier of every rank),
    # the resumed run prints it from the record the checkpoint keeps (log_record.py); only when
    # the writer reached `step` through a failed parameter all-gather is there no record, and
    # no run prints its loss: the demo says so and compares 9
    unlogged = (f"iteration(s) {step}: finished before the fault but not logged by the "
                "interrupted run") in out
    replayed = f"iteration {step}'s line printed from the checkpoint's record" in out
    assert not (replayed and unlogged), out
    assert (f"losses: all {9 if unlogged else 10} printed values equal (1-{step} from the "
            f"interrupted run, {step + 1}-10 from the resumed one)" in out
            or replayed and f"losses: all 10 printed values equal (1-{step - 1} from the "
            f"interrupted run, {step} from the checkpoint's record of it, {step + 1}-10 from the "
            "resumed one)" in out), out
    assert not unlogged or step > 4, out  # iteration 4 was logged before the kill
    assert re.search(r"final checkpoint, iteration 10: \d+ files, \d+ tensors, \d+ leaves: "
                     r"BIT-EXACT", out), out
    assert re.search(rf"^RESULT: MATCH - SIGKILL after iteration \d+, resumed from the dying "
                     rf"checkpoint of iteration {step}:", out, re.M), out

    # nothing the user was told about is deleted silently, and nothing else is left
    assert work.parent == tmpdir, f"the work directory {work} is not in the temp dir"
    assert f"removing {work} (the patched copy of Megatron-LM, the dataset, checkpoints and " \
           "logs); pass --keep DIR to keep them" in out
    assert "kept " not in out
    assert not work.exists()
    assert sorted(p.name for p in tmpdir.iterdir()) == [], "left behind in the temp dir"


IN_MEMORY_STAGES = [
    r"\[1/5\] copying .*",
    r"\[2/5\] generating a small dataset in .*",
    r"\[3/5\] training on 4 CPU ranks under ttprun \(10 iterations, .*\); SIGKILL to rank 1 "
    r"once iteration 4 is logged \.\.\.",
    r"\[4/5\] the in-memory recovery \.\.\.",
    r"\[5/5\] the uninterrupted reference run \(10 iterations, .*\) and the comparison \.\.\.",
]


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_demo_megatron_recovers_in_memory_by_default_and_matches(megatron_dir: Path,
                                                                 tmp_path: Path) -> None:
    """The product's default, shown by default: the killed rank is replaced, the job trains on
    to the end (exit 0), and its losses and final checkpoint are the uninterrupted run's."""
    done, elapsed = _run_demo(["--megatron", str(megatron_dir)], tmp_path / "tmp")
    out = done.stdout
    print(out)
    print(f"ttp-demo --megatron (in-memory) took {elapsed:.1f} s")
    assert done.returncode == 0, out + done.stderr
    assert "TTP_RECOVERY=in-memory" in out.splitlines()[0], out
    _stages_in_order(out, IN_MEMORY_STAGES)
    assert "ttprun exited 0 after" in out and "(the job went on: no restart)" in out, out
    shown = re.search(r"^      recovery 1 at iteration (\d+): rank\(s\) \[1\] replaced by a new "
                      r"process on the same node", out, re.M)
    assert shown, out
    step = int(shown.group(1))
    assert 4 <= step < 10
    assert "losses: all " in out and "(one run, recovered in memory after iteration" in out
    assert re.search(r"final checkpoint, iteration 10: \d+ files, \d+ tensors, \d+ leaves: "
                     r"BIT-EXACT", out), out
    assert re.search(rf"^RESULT: MATCH - SIGKILL after iteration \d+, recovered in memory at "
                     rf"iteration {step}:", out, re.M), out
    assert "dying checkpoint of iteration" not in out


def test_keep_dir_inside_the_megatron_checkout_is_refused(megatron_dir: Path,
                                                          tmp_path: Path) -> None:
    before = subprocess.run(["git", "-C", str(megatron_dir), "status", "--porcelain"],
                            capture_output=True, text=True, check=True).stdout
    done, _ = _run_demo(["--megatron", str(megatron_dir), "--keep",
                         str(megatron_dir / "demo-out")], tmp_path / "tmp", timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is inside --megatron" in done.stderr and "outside your checkout" in done.stderr
    assert not (megatron_dir / "demo-out").exists()
    after = subprocess.run(["git", "-C", str(megatron_dir), "status", "--porcelain"],
                           capture_output=True, text=True, check=True).stdout
    assert after == before


def _processes_mentioning(text: str) -> list:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append((int(entry.name), cmdline[:200]))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_the_demo_stops_every_rank_and_says_what_it_keeps(megatron_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A scheduler's SIGTERM mid-training: ttprun and all four ranks (in sessions of their own)
    are gone, and the output says the work directory is kept."""
    keep = tmp_path / "keep"
    env = dict(os.environ, TMPDIR=str(tmp_path), COLUMNS="1000")  # whole lines, to match them
    env.pop("TTP_CPU_BUILD_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "mindio_ttp.demo", "--megatron",
                             str(megatron_dir), "--keep", str(keep), "--steps", "200",
                             "--kill-step", "150"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        log = keep / "logs" / "faulty.log"
        deadline = time.monotonic() + 240
        while not (log.is_file() and "iteration        3/" in log.read_text(errors="replace")):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "training did not reach iteration 3"
            time.sleep(0.2)
        assert len(_processes_mentioning(str(keep / "Megatron-LM"))) >= 4, "ranks not found"
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + 15, out
    assert f"kept {keep} (the patched copy of Megatron-LM, the dataset, checkpoints and logs)" \
        in out
    deadline = time.monotonic() + 15
    while _processes_mentioning(str(keep)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(str(keep)) == [], "processes of the demo left running"
