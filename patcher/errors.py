"""Refusals: every reason `ttp-patch` stops without touching the tree, each with a hint.

The CLI turns these into a message on stderr and an exit code; nothing below the CLI prints or
exits, so the library (and the tests) see one typed outcome per reason.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

EXIT_OK = 0
EXIT_NOT_APPLIED = 1  # the tree's content is not what the request needs (verify, drift, anchors)
EXIT_ENVIRONMENT = 2  # cannot work here at all: usage, not a repo, wrong commit, unreadable file


class PatchError(Exception):
    """Base of every refusal: a message, an optional hint (what to do) and an exit code."""

    exit_code = EXIT_ENVIRONMENT

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def render(self) -> str:
        text = f"ttp-patch: error: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text

    def as_dict(self) -> Dict[str, Any]:
        """The refusal for a pipeline (`verify --json`): the class names the reason."""
        out: Dict[str, Any] = {
            "type": type(self).__name__,
            "message": self.message,
            "hint": self.hint,
            "exit_code": self.exit_code,
        }
        if hasattr(self, "paths"):
            out["paths"] = list(self.paths)
        return out


class UsageError(PatchError):
    """Bad arguments or a DIR that is not a usable directory."""


class NotAGitRepo(PatchError):
    """DIR exists but is not the root of a git work tree."""


class WrongCommit(PatchError):
    """HEAD is not the one commit the edits were written for."""


class MissingTarget(PatchError):
    """A file the edits need is absent from the work tree or from HEAD."""


class UnreadableTarget(PatchError):
    """A target's bytes cannot be edited safely: not UTF-8, CRLF, or not parseable."""


class ReadOnlyTarget(PatchError):
    """A target (or its directory) is not writable; we never override the user's protection."""


class WriteFailed(PatchError):
    """Writing failed half-way; every file already written was put back."""


class UnsafeTarget(PatchError):
    """A path we would write is a symlink, under one, not a regular file, or not git mode 100644."""


class Busy(PatchError):
    """Another ttp-patch holds the checkout's lock (.git/ttp-patch.lock)."""


class Interrupted(PatchError):
    """SIGINT/SIGTERM arrived; the tree was left exactly as before (or exactly done)."""

    def __init__(self, signum: int, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message, hint)
        self.exit_code = 128 + signum


class ManifestError(PatchError):
    """The record of the last apply under .git/ is unreadable or contradicts the tree."""


class ModifiedTarget(PatchError):
    """A target is neither pristine nor exactly our output (edited by hand, other device...)."""

    exit_code = EXIT_NOT_APPLIED

    def __init__(self, message: str, paths: Sequence[str], hint: Optional[str] = None) -> None:
        super().__init__(message, hint)
        self.paths = list(paths)


class AnchorError(PatchError):
    """An edit's anchor is missing or ambiguous in its function, or the edit is half-present."""

    exit_code = EXIT_NOT_APPLIED


class IncompatibleTree(PatchError):
    """The targets patch, but the rest of the tree is not what the runtime builds on."""

    exit_code = EXIT_NOT_APPLIED


class Drifted(PatchError):
    """Files changed after apply; reverting would discard someone's work."""

    exit_code = EXIT_NOT_APPLIED

    def __init__(self, message: str, paths: Sequence[str], hint: Optional[str] = None) -> None:
        super().__init__(message, hint)
        self.paths = list(paths)
