"""Runs a file's edits in memory: decode, assess, transform once, then prove the result.

Nothing here touches the disk. `plan_file` refuses (raises) when the bytes cannot be edited
safely or an edit's anchor is not where the guide says; otherwise it returns the new bytes
after checking they parse and that a second pass changes nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import List, Tuple

import libcst as cst

from .edits import Edit, FileIndex, State, edits_for
from .edits.base import ApplyOps, Assessment
from .errors import AnchorError, UnreadableTarget
from .options import Options


@dataclass
class FilePlan:
    path: str
    before: bytes
    after: bytes
    results: List[Tuple[Edit, Assessment]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.before != self.after


def decode(path: str, data: bytes) -> str:
    """UTF-8 text with LF newlines, or a refusal saying how to get there."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableTarget(
            f"{path}: not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 1]!r})",
            f"restore it with `git checkout -- {path}`",
        ) from None
    if "\r" in text:
        raise UnreadableTarget(
            f"{path}: has CR/CRLF line endings; the edits and patches/ are for LF files",
            f"check it out with LF: `git config core.autocrlf false && git checkout -- {path}`",
        )
    return text


def parse(path: str, data: bytes) -> cst.Module:
    text = decode(path, data)
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise UnreadableTarget(
            f"{path}:{exc.raw_line}:{exc.raw_column}: cannot parse: {exc.message}",
            f"restore it with `git checkout -- {path}`",
        ) from None


def assess_module(path: str, module: cst.Module, opts: Options) -> List[Tuple[Edit, Assessment]]:
    edits = edits_for(path)
    index = FileIndex.build(module, [e.scope for e in edits])
    return [(e, e.assess(module, index, opts)) for e in edits]


def _transform(path: str, module: cst.Module, opts: Options) -> Tuple[cst.Module, list]:
    results = assess_module(path, module, opts)
    drifted = [
        f"edit {edit.id} ({edit.number}) in {path}, "
        f"{f'function {edit.scope}()' if edit.scope else 'module level'}: {res.detail}; "
        f"anchor: {edit.anchor_text()!r}"
        for edit, res in results
        if res.state is State.DRIFTED
    ]  # every one: edits 0 and 1 share `import torch`, and one message should name both
    if drifted:
        raise AnchorError(
            "\n".join(drifted),
            "the file is not as Megatron-LM 285068c ships it; "
            f"`git diff -- {path}` shows what changed",
        )
    ops = [op for _, res in results if res.state is State.MISSING for op in res.ops]
    if not ops:
        return module, results
    return module.visit(ApplyOps(ops)), results


def plan_file(path: str, data: bytes, opts: Options) -> FilePlan:
    """The bytes `apply` would write for `data`, proven to parse and to be a fixed point."""
    module = parse(path, data)
    new_module, results = _transform(path, module, opts)
    new_text = new_module.code
    try:
        ast.parse(new_text, filename=path)
    except SyntaxError as exc:  # pragma: no cover - would be a bug in an edit
        raise AnchorError(f"{path}: the edited file does not parse: {exc}") from None
    again, second = _transform(path, cst.parse_module(new_text), opts)
    not_applied = [e.id for e, r in second if r.state is not State.APPLIED]
    if again.code != new_text or not_applied:  # pragma: no cover - would be a bug in an edit
        raise AnchorError(f"{path}: a second pass would change the file again ({not_applied})")
    return FilePlan(path, data, new_text.encode("utf-8"), results)
