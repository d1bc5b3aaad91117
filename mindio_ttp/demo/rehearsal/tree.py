"""A private, patchable copy of a Megatron-LM checkout.

``git clone --shared`` of ``TTP_MEGATRON_DIR`` at the pinned commit: the copy reads objects
from the source repository but never writes to it (a ``git worktree add`` would register itself
in the source's ``.git``, which may be read-only and leaks an entry if a test dies), and
removing it is a plain ``rmtree``. The copy is a real git repository at a detached HEAD, which
is what ``ttp-patch`` checks before it edits.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Tuple

MEGATRON_COMMIT = "285068c8108e0e8e6538f54fe27c3ee86c5217a2"
GIT_TIMEOUT_S = 180


def _git(args: Sequence[str], cwd: Path | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=GIT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def copy_megatron_tree(source: Path, dest: Path, commit: str = MEGATRON_COMMIT) -> Path:
    """Clone ``source`` into the new folder ``dest`` at ``commit`` (detached); return ``dest``."""
    source, dest = Path(source).resolve(), Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} exists and is not empty: pick a fresh folder")
    _git(["clone", "--quiet", "--shared", "--no-checkout", str(source), str(dest)])
    _git(["-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit],
         cwd=dest)
    if not (dest / "pretrain_gpt.py").is_file():
        raise RuntimeError(f"{source} at {commit[:7]} has no pretrain_gpt.py")
    return dest


@contextlib.contextmanager
def stock_and_patched(source: Path, keep: Optional[Path] = None, device: str = "cpu",
                      prefix: str = "ttp-compare-") -> Iterator[Tuple[Path, Path, Path, Any]]:
    """``(work, stock tree, patched tree, tiny dataset)``: what a comparison of stock Megatron
    with the patched tree starts from. ``work`` is ``keep`` (kept) or a temporary directory."""
    from mindio_ttp.demo.rehearsal.data import make_tiny_dataset

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(keep) if keep is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        stock = copy_megatron_tree(source, work / "stock" / "Megatron-LM")
        patched = copy_megatron_tree(source, work / "ttp" / "Megatron-LM")
        apply_ttp_patch(patched, device)
        yield work, stock, patched, make_tiny_dataset(patched, work / "data")


class PatchRefused(RuntimeError):
    """ttp-patch refused the tree: its own message, and its exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def apply_ttp_patch(tree: Path, device: str = "cpu", timeout_s: float = 120,
                    allow_modified: bool = False) -> str:
    """``ttp-patch apply TREE --device DEVICE [--allow-modified]``; returns its output, raises
    PatchRefused with it (the user's own words to act on) when it refuses."""
    cmd = [sys.executable, "-c", "import sys; from patcher.cli import main; sys.exit(main())",
           "apply", str(tree), "--device", device]
    if allow_modified:
        cmd.append("--allow-modified")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise PatchRefused(f"ttp-patch apply {tree} --device {device} failed "
                           f"(exit {done.returncode}):\n{done.stdout}\n{done.stderr}",
                           done.returncode)
    return done.stdout + done.stderr


def copy_work_tree_changes(source: Path, dest: Path) -> bool:
    """Put the uncommitted changes of ``source``'s tracked files into the clone ``dest`` (at the
    same HEAD), so the copy holds what ``ttp-patch apply`` would patch in ``source``; True
    when there were any."""
    diff = subprocess.run(["git", "-C", str(source), "diff", "HEAD", "--binary"],
                          capture_output=True, timeout=GIT_TIMEOUT_S, check=True).stdout
    if not diff:
        return False
    done = subprocess.run(["git", "-C", str(dest), "apply", "--binary", "-"], input=diff,
                          capture_output=True, timeout=GIT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"could not copy the uncommitted changes of {source}: "
                           f"{done.stderr.decode(errors='replace').strip()}")
    return True
