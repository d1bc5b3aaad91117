"""Statements compared by meaning: AST keys (formatting-blind identity) and shapes.

Detection must recognise the guide's code whatever its spacing or comments, and tell a
changed insertion (same call, other arguments) from a missing one; insertion must build nodes
from the guide's text that carry its comments. Both live here.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from typing import Optional, Tuple

import libcst as cst

EMPTY_MODULE = cst.Module(body=[])


def _statement_ast(node: cst.CSTNode) -> Optional[ast.stmt]:
    try:
        body = ast.parse(textwrap.dedent(EMPTY_MODULE.code_for_node(node))).body
    except SyntaxError:  # pragma: no cover - a parsed CST statement always has an AST
        return None
    return body[0] if body else None


def node_key(node: cst.CSTNode) -> str:
    """A formatting-blind identity for a statement: its Python AST, comments and layout dropped."""
    return _key_and_shape(_statement_ast(node))[0]


def node_shape(node: cst.CSTNode) -> str:
    """What a statement is about, values aside: the call it makes or the name it binds.

    Two statements with one shape are versions of each other (`ttp_start_updating_os(-1)` and
    `(-2)`), so a shape of ours found in the scope means the edit was changed, not left out.
    """
    return _key_and_shape(_statement_ast(node))[1]


def describe(node: cst.CSTNode) -> Tuple[str, str]:
    """(key, shape) of a statement from one code generation and one parse."""
    return _key_and_shape(_statement_ast(node))


def _key_and_shape(stmt: Optional[ast.stmt]) -> Tuple[str, str]:
    if stmt is None:  # pragma: no cover
        return "", ""
    key = ast.dump(stmt)
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        return key, f"call {ast.unparse(stmt.value.func)}"
    if isinstance(stmt, ast.Assign):
        return key, "assign " + ",".join(ast.unparse(t) for t in stmt.targets)
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return key, f"assign {ast.unparse(stmt.target)}"
    if isinstance(stmt, (ast.Global, ast.Nonlocal)):
        return key, "global " + ",".join(stmt.names)
    if isinstance(stmt, ast.Import):
        return key, "import " + ",".join(a.name for a in stmt.names)
    if isinstance(stmt, ast.ImportFrom):
        return key, f"from {stmt.module} import " + ",".join(a.name for a in stmt.names)
    if isinstance(stmt, ast.If):
        return key, f"if {ast.unparse(stmt.test)}"
    return key, key


@functools.lru_cache(maxsize=256)
def source_key(src: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(src)).body[0])


def parse_statements(src: str, module: cst.Module) -> Tuple[cst.BaseStatement, ...]:
    """The guide's text as statements, leading comments kept on the first one.

    A snippet's leading comments land in `Module.header`; moved onto the first statement they
    are written at the indentation of whatever block receives the statement.
    """
    return _parse_statements(src, module.default_indent, module.default_newline)


@functools.lru_cache(maxsize=256)  # CST nodes are immutable, so sharing them is safe
def _parse_statements(src: str, indent: str, newline: str) -> Tuple[cst.BaseStatement, ...]:
    config = cst.PartialParserConfig(default_indent=indent, default_newline=newline)
    snippet = cst.parse_module(textwrap.dedent(src), config=config)
    body = list(snippet.body)
    if body and snippet.header:
        header = [line.with_changes(indent=True) for line in snippet.header]
        body[0] = body[0].with_changes(leading_lines=[*header, *body[0].leading_lines])
    return tuple(body)
