"""Read-only questions to the Megatron checkout, through GitPython: where, which commit, HEAD bytes.

Blob bytes come from the object store (`data_stream`), never from `git show`, which strips the
final newline and would make byte comparisons lie.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import git

from . import pin as _pin
from .edits import TARGET_FILES
from .errors import MissingTarget, NotAGitRepo, UsageError, WrongCommit
from .pin import PINNED_COMMIT, Pin

__all__ = ["PINNED_COMMIT", "Checkout", "open_checkout"]


@dataclass
class Checkout:
    root: Path
    repo: git.Repo
    commit: str

    @property
    def git_dir(self) -> Path:
        """The per-work-tree git directory (a linked worktree has its own under .git/worktrees)."""
        return Path(self.repo.git_dir)

    def head_blob(self, path: str) -> Optional[bytes]:
        try:
            blob = self.repo.commit(self.commit).tree / path
        except KeyError:
            return None
        return blob.data_stream.read()

    def require_head_blob(self, path: str) -> bytes:
        data = self.head_blob(path)
        if data is None:
            raise MissingTarget(
                f"{path} is not in commit {self.commit[:12]}", "is this a Megatron-LM checkout?"
            )
        return data

    def head_blob_ids(self) -> Dict[str, Optional[str]]:
        """The targets' blob ids at HEAD (None: not in HEAD), from the tree objects alone."""
        tree = self.repo.commit(self.commit).tree
        out: Dict[str, Optional[str]] = {}
        for path in TARGET_FILES:
            try:
                out[path] = (tree / path).hexsha
            except KeyError:
                out[path] = None
        return out

    def blob_at(self, commit: str, path: str) -> Optional[bytes]:
        """A file's bytes at another commit (None when unknown here): the record names one."""
        try:
            blob = self.repo.commit(commit).tree / path
        except (KeyError, ValueError, git.BadName):
            return None
        return blob.data_stream.read()

    def pin(self) -> Pin:
        return _pin.pinned()

    def relation(self, want: str) -> str:
        return _relation(self.repo, want, self.commit)

    def close(self) -> None:
        self.repo.close()


def open_checkout(directory: str) -> Checkout:
    """The work tree at `directory`, which must be its root and have a commit.

    Any HEAD is opened: whether its files are the pinned ones is a question per file, asked by
    apply (patcher/pin.py), and status, verify and revert read the files whatever HEAD is.
    """
    root = Path(directory)
    if not root.exists():
        raise UsageError(f"{directory}: no such directory", "give the Megatron-LM checkout")
    if not root.is_dir():
        raise UsageError(f"{directory}: not a directory", "give the Megatron-LM checkout")
    root = root.resolve()
    try:
        repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise NotAGitRepo(
            f"{directory}: not a git repository",
            f"clone Megatron-LM and `git checkout {PINNED_COMMIT}` there",
        ) from None
    if repo.bare or repo.working_tree_dir is None:
        repo.close()
        raise NotAGitRepo(f"{directory}: a bare repository has no files to patch")
    if Path(repo.working_tree_dir).resolve() != root:
        top = repo.working_tree_dir
        repo.close()
        raise NotAGitRepo(
            f"{directory}: inside a git work tree but not its root ({top})",
            f"run on the Megatron-LM root: ttp-patch ... {top}",
        )
    want = _pin.pinned().commit
    try:
        found = repo.head.commit.hexsha
    except ValueError:
        repo.close()
        raise WrongCommit(
            f"{directory}: the repository has no commits", checkout_hint(root, want)
        ) from None
    return Checkout(root, repo, found)


def checkout_hint(root: Path, want: str) -> str:
    return f"git -C {root} checkout {want}   (then run ttp-patch again)"


def _relation(repo: git.Repo, want: str, found: str) -> str:
    """Older or newer than the pin, when the pinned commit is known here."""
    try:
        repo.commit(want)
    except (ValueError, git.BadName):
        return " (the pinned commit is not in this repository: fetch it first)"
    try:
        if repo.is_ancestor(want, found):
            return " (newer than the pinned commit)"
        if repo.is_ancestor(found, want):
            return " (older than the pinned commit)"
    except git.GitCommandError:
        pass
    return " (not on the pinned commit's line)"
