"""The supported-stack table, measured: one venv per torch version, real Megatron-LM 285068c.

    python bench/bench_stack.py --megatron /path/to/Megatron-LM [--venvs DIR]
        [--torch 1.13.1,2.1.2,2.13.0,2.14.1] [--work DIR] [--json OUT]

For each torch version it makes (or reuses) ``DIR/torch-X`` with ``pip install torch==X`` (and
``numpy<2`` for builds compiled against numpy 1.x), installs this checkout into it (editable,
``--no-deps``, so the version under test is the one that runs) and Megatron's CPU imports, then:

* ``rehearsal``: ``ttp-demo --megatron --recovery dying-checkpoint`` in that venv: a
  ``--device cpu`` tree trains the tiny GPT on 4 CPU ranks under ttprun, rank 1 gets SIGKILL
  after iteration 4 is logged, the survivors write the dying checkpoint, the same command
  resumes from it, and an uninterrupted run checks the losses and the final checkpoint bit for
  bit (``RESULT: MATCH``);
* ``in memory``: ``ttp-demo --megatron --recovery in-memory`` (ttprun's default): the same
  fault, rank 1 replaced by a new process refilled from its replica partner, no restart, the
  same bit-for-bit check;
* ``cuda tree``: a ``--device cuda`` tree imports Megatron and reads a checkpoint with nothing
  of the CPU adaptor (testkit/cuda_tree_probe.py: what a CPU can exercise of a CUDA tree);
* ``compat``: which drift fixes that torch needed (``python -m mindio_ttp.compat``);
* ``private names``: whether that torch has every private name ttprun overrides or reads as it
  uses them (``python -m mindio_ttp.launch.torch_private``: what drifted, or "all there" with
  the differences ttprun accepts), and ``tests/runtime/test_torch_private.py`` run by that
  venv's pytest.

It prints a Markdown table, one row per torch, and writes the rows as JSON with ``--json``.
Each ``pip install torch==X`` other than the local CPU build pulls a CUDA build (GBs); the CUDA
builds run on CPU. Not part of CI (minutes per version); the README's table comes from here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testkit.cuda_tree_probe import megatron_shaped_checkpoint, run_probe  # noqa: E402

DEFAULT_TORCH = ("1.13.1", "2.1.2", "2.13.0", "2.14.1")
# torch builds compiled against numpy 1.x (torch < 2.3) fail to convert arrays under numpy 2.
NUMPY_1 = ("1.", "2.0.", "2.1.", "2.2.")
# The package's own imports and Megatron-LM 285068c's on CPU (setup.cfg, extras "test").
DEPS = ("libcst>=1.1,<2", "gitpython>=3.1", "unidiff>=0.7", "xxhash>=3.0", "blake3>=0.4",
        "psutil>=5", "pybind11>=2.10", "regex", "six",
        "pytest", "pytest-timeout")  # tests/runtime/test_torch_private.py in each venv
PIP_TIMEOUT_S = 3600
DEMO_TIMEOUT_S = 1800


@dataclass
class Row:
    torch: str
    python: str = ""
    numpy: str = ""
    cuda: str = ""  # torch.version.cuda of the build ("cpu" when none)
    installs: bool = False
    compat: List[str] = field(default_factory=list)
    cuda_tree: str = "not run"
    torch_names: str = "not run"  # launch/torch_private.py: the private names ttprun uses
    rehearsal: str = "not run"  # --recovery dying-checkpoint
    saved: Optional[int] = None
    seconds: float = 0.0
    note: str = ""
    log: str = ""  # the rehearsal's output, when it failed (said on stderr, not in the table)
    in_memory: str = "not run"  # --recovery in-memory
    recovered_at: Optional[int] = None
    in_memory_seconds: float = 0.0
    in_memory_note: str = ""
    in_memory_log: str = ""


def _run(cmd: List[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def make_venv(venvs: Path, version: str, log: Path) -> Path:
    """``venvs/torch-VERSION`` with that torch, this checkout and Megatron's imports."""
    venv = venvs / f"torch-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], 300, check=True)
    numpy = "numpy<2" if version.startswith(NUMPY_1) else "numpy"
    steps = [
        [str(python), "-m", "pip", "install", "-q", f"torch=={version}", numpy],
        [str(python), "-m", "pip", "install", "-q", *DEPS],
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO)],
    ]
    with open(log, "a") as out:
        for cmd in steps:
            done = _run(cmd, PIP_TIMEOUT_S)
            out.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}\n")
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[3:])} failed (exit {done.returncode}); "
                                   f"see {log}: {done.stderr.strip()[-500:]}")
    return python


def describe(python: Path, row: Row) -> None:
    code = ("import json, sys, numpy, torch; print(json.dumps([sys.version.split()[0], "
            "torch.__version__, numpy.__version__, torch.version.cuda or 'cpu']))")
    row.python, row.torch, row.numpy, row.cuda = json.loads(
        _run([str(python), "-c", code], 300, check=True).stdout)
    done = _run([str(python), "-m", "mindio_ttp.compat"], 300, check=True)
    row.compat = json.loads(done.stdout)["applied"]
    row.torch_names = private_names(python)


def private_names(python: Path) -> str:
    """launch/torch_private.py's verdict in that venv, then its test file's."""
    done = _run([str(python), "-m", "mindio_ttp.launch.torch_private"], 300)
    lines = done.stdout.strip().splitlines()
    # an accepted difference reads "accepted: WHAT: WHY": the table names WHAT
    accepted = [ln[len("accepted: "):].split(": ")[0] for ln in lines
                if ln.startswith("accepted: ")]
    drifted = [ln for ln in lines if not ln.startswith("accepted: ")]
    if done.returncode == 0:
        said = "all there" + (f" (accepted: {'; '.join(accepted)})" if accepted else "")
    else:
        said = "DRIFT: " + ("; ".join(drifted) or f"exit {done.returncode}")
    test = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/runtime/test_torch_private.py"], 600, cwd=REPO)
    tail = (test.stdout.strip().splitlines() or [f"exit {test.returncode}"])[-1]
    counts = re.sub(r"\s*in [0-9.]+s.*$", "", tail.strip("= "))
    failed = re.findall(r"^FAILED \S+::(\w+)", test.stdout, flags=re.M)
    return f"{said}; test_torch_private: {counts}" + (f" ({', '.join(failed)})" if failed
                                                       else "")


def cuda_tree(python: Path, megatron: Path, work: Path) -> str:
    tree = work / "cuda-tree"
    if not tree.exists():
        _run(["git", "clone", "-q", "--shared", str(megatron), str(tree)], 300, check=True)
        done = _run([str(python), "-m", "patcher.cli", "apply", str(tree), "--device", "cuda"],
                    300)
        if done.returncode != 0:
            return f"apply failed: {done.stderr.strip()[-200:]}"
    ckpt = work / "ckpt"
    if not ckpt.exists():
        megatron_shaped_checkpoint(ckpt)
    try:
        got = run_probe(str(python), tree, ckpt)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"FAIL ({str(exc).strip().splitlines()[-1][:160]})"
    ok = (got["order"] == ["mindio_ttp.compat", "megatron"] and not got["adaptor"]
          and got["inf"] and got["view"][2] and got["loaded"][0] == 3)
    return "imports, loads" if ok else f"FAIL {got}"


def rehearsal(python: Path, megatron: Path, work: Path, recovery: str
              ) -> Tuple[str, Optional[int], float, str, str]:
    """``ttp-demo --megatron --recovery RECOVERY``: (verdict, the iteration saved or recovered
    at, seconds, note, log path when it failed)."""
    log = work / f"ttp-demo-{recovery}.log"
    cmd = [str(python), "-m", "mindio_ttp.demo", "--megatron", str(megatron), "--quiet",
           "--recovery", recovery, "--keep", str(work / f"demo-{recovery}")]
    t0 = time.monotonic()
    try:
        done = _run(cmd, DEMO_TIMEOUT_S, cwd=work)
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        text = f"timed out after {DEMO_TIMEOUT_S} s\n{exc.stdout or ''}"
        done = None
    seconds = time.monotonic() - t0
    log.write_text(text)
    result = re.findall(r"^RESULT: (.*)$", text, flags=re.M)
    # the demo wraps its lines: any whitespace between the words
    at = re.findall(r"(?:resumed\s+from\s+the\s+dying\s+checkpoint\s+of|recovered\s+in\s+"
                    r"memory\s+at)\s+iteration\s+(\d+)", text)
    iteration = int(at[-1]) if at else None
    if done is not None and done.returncode == 0 and result and result[-1].startswith("MATCH"):
        return "MATCH", iteration, seconds, "", ""
    if "ttprun: error: torch " in text:
        note = "ttprun refused this torch at start (exit 2: see the private-names column)"
    else:
        errors = re.findall(r"^\s*\|?\s*(\w+(?:Error|Exception): .*)$", text, flags=re.M)
        note = (errors or result or text.strip().splitlines() or ["no output"])[-1].strip()
    return "FAIL", iteration, seconds, note[:160], str(log)


def measure(version: str, venvs: Path, megatron: Path, work: Path) -> Row:
    row = Row(torch=version)
    work.mkdir(parents=True, exist_ok=True)
    try:
        python = make_venv(venvs, version, work / "pip.log")
    except (RuntimeError, subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
        row.note = f"does not install here: {exc}"
        return row
    row.installs = True
    describe(python, row)
    row.cuda_tree = cuda_tree(python, megatron, work)
    row.rehearsal, row.saved, row.seconds, row.note, row.log = rehearsal(
        python, megatron, work, "dying-checkpoint")
    (row.in_memory, row.recovered_at, row.in_memory_seconds, row.in_memory_note,
     row.in_memory_log) = rehearsal(python, megatron, work, "in-memory")
    return row


def _verdict(verdict: str, iteration: Optional[int], seconds: float, note: str,
             what: str) -> str:
    if verdict == "MATCH":
        return f"MATCH: bit-exact, {what} {iteration} ({seconds:.0f} s)"
    if verdict == "not run":
        return verdict
    return f"{verdict} {note} ({seconds:.0f} s)".strip()


def table(rows: List[Row]) -> str:
    lines = ["| torch | Python | numpy | build | drift fixes applied (compat) | private names "
             "ttprun uses | `--device cuda` tree on CPU | kill rank 1, dying checkpoint, "
             "resume (real Megatron, 4 CPU ranks) | kill rank 1, in-memory recovery (the "
             "same) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        build = "CPU" if r.cuda == "cpu" else f"CUDA {r.cuda}"
        fixes = ", ".join(r.compat) or "none needed"
        dying = _verdict(r.rehearsal, r.saved, r.seconds, r.note, "from iteration")
        memory = _verdict(r.in_memory, r.recovered_at, r.in_memory_seconds, r.in_memory_note,
                          "recovered at iteration")
        lines.append(f"| {r.torch} | {r.python} | {r.numpy} | {build if r.installs else '-'} | "
                     f"{fixes if r.installs else '-'} | {r.torch_names} | {r.cuda_tree} | "
                     f"{dying} | {memory} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron", type=Path, required=True,
                   help="a Megatron-LM checkout at 285068c (only read)")
    p.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "ttp-stack-venvs",
                   help="where the venvs are made or reused (several GB each)")
    p.add_argument("--torch", default=",".join(DEFAULT_TORCH), help="comma-separated versions")
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one, kept)")
    p.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-stack-"))
    args.venvs.mkdir(parents=True, exist_ok=True)
    rows: List[Row] = []
    env_note: Dict[str, str] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                "cores": str(os.cpu_count())}
    for version in [v.strip() for v in args.torch.split(",") if v.strip()]:
        print(f"bench_stack: torch {version} ...", file=sys.stderr, flush=True)
        row = measure(version, args.venvs, args.megatron.resolve(), work / f"torch-{version}")
        print(f"bench_stack: torch {version}: dying checkpoint {row.rehearsal} "
              f"({row.seconds:.0f} s) {row.note} {row.log}; in memory {row.in_memory} "
              f"({row.in_memory_seconds:.0f} s) {row.in_memory_note} {row.in_memory_log}; "
              f"cuda tree {row.cuda_tree}", file=sys.stderr, flush=True)
        rows.append(row)
    print(f"bench_stack: work in {work}", file=sys.stderr)
    print(f"Measured {env_note['date']} on {env_note['cores']} cores by "
          f"`python bench/bench_stack.py --megatron DIR --torch {args.torch}`\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({**env_note, "rows": [asdict(r) for r in rows]},
                                        indent=2))
    return 0 if all(r.rehearsal == r.in_memory == "MATCH" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
