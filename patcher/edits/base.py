"""The four shapes the guide's edits take, and the machinery they share.

Every edit answers one question about a parsed file, `assess()`: is it applied, missing or
drifted, and if missing, which statements go where (`Op`s). Detection compares statements
through Python's `ast`, so formatting and comments do not matter and an edit made by hand
following the guide is recognised; insertion builds LibCST nodes from the guide's own text, so
what we write carries the guide's comments and the file's indentation.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import libcst as cst

from ..options import Options
from .statements import (
    EMPTY_MODULE,
    describe,
    node_key,
    node_shape,
    parse_statements,
    source_key,
)

Block = Union[cst.Module, cst.IndentedBlock]
Rewrite = Callable[[cst.BaseStatement], cst.BaseStatement]


class State(str, Enum):
    APPLIED = "applied"
    MISSING = "missing"
    DRIFTED = "drifted"
    # in place, but changed by hand since apply inside what apply inserted: revert refuses it
    # (status reads the record, not the edit itself, to say so)
    MODIFIED = "modified"


@dataclass(frozen=True)
class Op:
    """Change the statement at `block.body[index]`: put statements before/after it, rewrite it."""

    block: Block
    index: int
    before: Tuple[cst.BaseStatement, ...] = ()
    after: Tuple[cst.BaseStatement, ...] = ()
    rewrite: Optional[Rewrite] = None


@dataclass
class Assessment:
    state: State
    detail: str = ""
    ops: List[Op] = field(default_factory=list)
    inferred: Dict[str, object] = field(default_factory=dict)  # e.g. the device a file shows


@dataclass(frozen=True)
class Site:
    block: Block
    index: int
    stmt: cst.BaseStatement


class FileIndex(cst.CSTVisitor):
    """One walk of a module: every statement of the scopes the file's edits care about.

    A scope is a top-level function name, or None for module level. Statements in nested
    compound blocks (loops, ifs) belong to the enclosing scope; nested defs and classes are
    their own scopes and are skipped, so `evaluate()`'s `iteration += 1` never counts for
    `train()`.
    """

    def __init__(self, scopes: Sequence[Optional[str]]) -> None:
        super().__init__()
        self._wanted = set(scopes)
        self._stack: List[str] = []  # names of enclosing defs/classes, outermost first
        self.sites: Dict[Optional[str], List[Site]] = {s: [] for s in self._wanted}
        self.top_defs: Dict[str, List[Site]] = {}
        self._cache: Dict[int, Tuple[str, str]] = {}  # id(stmt) -> (key, shape)

    @classmethod
    def build(cls, module: cst.Module, scopes: Sequence[Optional[str]]) -> FileIndex:
        index = cls(scopes)
        module.visit(index)
        return index

    def _scope(self) -> Optional[str]:
        if not self._stack:
            return None
        return self._stack[0] if len(self._stack) == 1 else "<nested>"

    def _record(self, block: Block) -> None:
        scope = self._scope()
        if scope in self._wanted:
            for i, stmt in enumerate(block.body):
                self.sites[scope].append(Site(block, i, stmt))
        if isinstance(block, cst.Module):
            for i, stmt in enumerate(block.body):
                if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                    self.top_defs.setdefault(stmt.name.value, []).append(Site(block, i, stmt))

    def visit_Module(self, node: cst.Module) -> bool:
        self._record(node)
        return True

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
        self._record(node)
        return True

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return False  # no blocks inside: skipping its expressions makes the walk several x faster

    def _enter(self, name: str) -> bool:
        self._stack.append(name)
        return self._scope() in self._wanted

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return self._enter(node.name.value)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._stack.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return self._enter(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self._stack.pop()

    def _described(self, stmt: cst.CSTNode) -> Tuple[str, str]:
        cached = self._cache.get(id(stmt))
        if cached is None:
            cached = self._cache[id(stmt)] = describe(stmt)
        return cached

    def key(self, stmt: cst.CSTNode) -> str:
        return self._described(stmt)[0]

    def shape(self, stmt: cst.CSTNode) -> str:
        return self._described(stmt)[1]

    def simple(self, scope: Optional[str]) -> List[Site]:
        """The one-line statements of a scope: every anchor is one, and so are most insertions."""
        return [s for s in self.sites.get(scope, ()) if isinstance(s.stmt, cst.SimpleStatementLine)]

    def find(self, scope: Optional[str], key: str) -> List[Site]:
        return [s for s in self.simple(scope) if self.key(s.stmt) == key]


def where(scope: Optional[str]) -> str:
    return "at module level" if scope is None else f"in function {scope}()"


class Edit:
    """One numbered edit of the guide (EDITS.md), with a stable id used in status and errors."""

    id: str = ""
    number: str = ""
    file: str = ""
    scope: Optional[str] = None  # function whose body holds the anchor; None = module level
    anchor: str = ""  # the anchor as Megatron 285068c spells it
    summary: str = ""

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        raise NotImplementedError

    def anchor_text(self) -> str:
        return " ".join(self.anchor.split())


class InsertAfterAnchor(Edit):
    """Insert the guide's statements right after a statement, in the same block."""

    inserted: str = ""

    def inserted_source(self, opts: Options, followers: Sequence[cst.BaseStatement]) -> str:
        """The text to insert; `followers` lets detection read back a parameter (the port)."""
        return self.inserted

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        sites = index.find(self.scope, source_key(self.anchor))
        if len(sites) != 1:
            how = "not found" if not sites else f"found {len(sites)} times"
            return Assessment(State.DRIFTED, f"anchor {how} {where(self.scope)}")
        site = sites[0]
        followers = site.block.body[site.index + 1 :]
        stmts = parse_statements(self.inserted_source(opts, followers), module)
        wanted = [node_key(s) for s in stmts]
        if [index.key(s) for s in followers[: len(wanted)]] == wanted:
            return Assessment(State.APPLIED)
        shapes = {index.shape(s.stmt) for s in index.simple(self.scope)}
        if any(node_shape(s) in shapes for s in stmts):
            return Assessment(
                State.DRIFTED, f"partly present or not right after the anchor {where(self.scope)}"
            )
        return Assessment(State.MISSING, ops=[Op(site.block, site.index, after=stmts)])


class ReplaceAnchor(Edit):
    """Rewrite one statement in place, keeping its layout (continuations, comments)."""

    replacement: str = ""

    def rewrite(self, stmt: cst.BaseStatement) -> cst.BaseStatement:
        raise NotImplementedError

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        old = index.find(self.scope, source_key(self.anchor))
        new = index.find(self.scope, source_key(self.replacement))
        if not old and len(new) == 1:
            return Assessment(State.APPLIED)
        if len(old) == 1 and not new:
            return Assessment(
                State.MISSING, ops=[Op(old[0].block, old[0].index, rewrite=self.rewrite)]
            )
        return Assessment(
            State.DRIFTED,
            f"{where(self.scope)}: original statement found {len(old)} times, "
            f"replacement found {len(new)} times (expected exactly one of them once)",
        )


class InsertBeforeTopLevelDef(Edit):
    """Insert module-level functions right above a top-level def, two blank lines apart."""

    before_def: str = ""
    inserted: str = ""

    def anchor_text(self) -> str:
        return f"def {self.before_def}("

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        sites = index.top_defs.get(self.before_def, [])
        if len(sites) != 1:
            how = "not found" if not sites else f"found {len(sites)} times"
            return Assessment(State.DRIFTED, f"def {self.before_def}() {how} at module level")
        site = sites[0]
        stmts = parse_statements(self.inserted, module)
        wanted = [node_key(s) for s in stmts]
        preceding = site.block.body[max(0, site.index - len(wanted)) : site.index]
        if [index.key(s) for s in preceding] == wanted:
            return Assessment(State.APPLIED)
        names = {s.name.value for s in stmts if isinstance(s, cst.FunctionDef)}
        if names & set(index.top_defs):
            return Assessment(
                State.DRIFTED,
                f"{', '.join(sorted(names & set(index.top_defs)))} defined, "
                f"but not as the guide gives it right before def {self.before_def}()",
            )
        spaced = tuple(
            s.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
            if isinstance(s, cst.FunctionDef)
            else s
            for s in stmts
        )
        return Assessment(State.MISSING, ops=[Op(site.block, site.index, before=spaced)])


class DecorateTopLevelDef(Edit):
    """Put a decorator on a top-level def, on the line right above `def`."""

    def_name: str = ""
    decorator: str = ""

    def anchor_text(self) -> str:
        return f"def {self.def_name}("

    def assess(self, module: cst.Module, index: FileIndex, opts: Options) -> Assessment:
        sites = index.top_defs.get(self.def_name, [])
        if len(sites) != 1 or not isinstance(sites[0].stmt, cst.FunctionDef):
            how = "not found" if not sites else f"found {len(sites)} times"
            return Assessment(State.DRIFTED, f"def {self.def_name}() {how} at module level")
        wanted = ast.dump(ast.parse(self.decorator, mode="eval"))
        have = [
            ast.dump(ast.parse(EMPTY_MODULE.code_for_node(d.decorator), mode="eval"))
            for d in sites[0].stmt.decorators
        ]
        count = have.count(wanted)
        if count == 1:
            return Assessment(State.APPLIED)
        if count > 1:
            return Assessment(State.DRIFTED, f"@{self.decorator} is there {count} times")
        return Assessment(
            State.MISSING, ops=[Op(sites[0].block, sites[0].index, rewrite=self._add)]
        )

    def _add(self, stmt: cst.BaseStatement) -> cst.BaseStatement:
        assert isinstance(stmt, cst.FunctionDef)
        new = cst.Decorator(decorator=cst.parse_expression(self.decorator))
        return stmt.with_changes(decorators=[*stmt.decorators, new])


class ApplyOps(cst.CSTTransformer):
    """The one transformer that writes: splices every planned Op into its block in one walk.

    Ops name blocks of the tree being walked (by identity), so several edits of one file are
    applied in a single pass, nested edits included (a decorator on `train` and statements
    inside `train`).
    """

    def __init__(self, ops: Sequence[Op]) -> None:
        super().__init__()
        self._ops: Dict[int, Dict[int, List[Op]]] = {}
        for op in ops:
            self._ops.setdefault(id(op.block), {}).setdefault(op.index, []).append(op)

    def _splice(self, original: Block, updated: Block) -> Block:
        per_index = self._ops.get(id(original))
        if not per_index:
            return updated
        body: List[cst.BaseStatement] = []
        for i, stmt in enumerate(updated.body):
            before: List[cst.BaseStatement] = []
            after: List[cst.BaseStatement] = []
            for op in per_index.get(i, ()):
                before.extend(op.before)
                after.extend(op.after)
                if op.rewrite is not None:
                    stmt = op.rewrite(stmt)
            body.extend([*before, stmt, *after])
        return updated.with_changes(body=body)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return False  # ops only name blocks; expressions need no visit

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return self._splice(original_node, updated_node)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return self._splice(original_node, updated_node)
