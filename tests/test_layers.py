"""The runtime's imports run one way (issue 25 §7): the API face on top, the control plane's
tiers below it, the fault-time path below the control plane, and no circle anywhere.

Read from the source with `ast`, every import counted, the ones inside functions too: a
function-level import is still a dependency, only a later one, and a circle through it is the
kind that works until the day the import order changes. A package's own `__init__` re-exporting
its submodules is an edge like any other. An import under `if TYPE_CHECKING:` is not: it never
runs, and it names a type for an annotation only.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom: a module may import only from its own layer's room or from a layer below it.
# Each entry is a module prefix; the longest prefix that matches names a module's room.
LAYERS: List[List[str]] = [
    ["mindio_ttp.demo"],
    ["mindio_ttp.megatron_ttp"],
    ["mindio_ttp.framework_ttp"],
    ["mindio_ttp.launch"],
    ["mindio_ttp.control.rank"],
    ["mindio_ttp.control.controller"],
    ["mindio_ttp.control.agent"],
    ["mindio_ttp.control.relay"],
    ["mindio_ttp.control.wire"],
    ["mindio_ttp.recovery"],
    ["mindio_ttp.drill"],
    ["mindio_ttp.hooks", "mindio_ttp.handlers"],
    ["mindio_ttp.faulttime"],
    ["mindio_ttp.cpu_adaptor", "mindio_ttp.compat"],
    ["mindio_ttp.config", "mindio_ttp.log", "mindio_ttp.statemachine", "mindio_ttp.control"],
]


def modules(*roots: str) -> Dict[str, Path]:
    out: Dict[str, Path] = {}
    for root in roots:
        for f in (ROOT / root).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = f
    return out


def imports(mods: Dict[str, Path]) -> Dict[str, Set[str]]:
    """module -> the modules of `mods` it imports, anywhere in its body."""
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        tree = ast.parse(f.read_text(), str(f))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(block.test)
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # each name is a submodule, or else an attribute of `base`
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != m:
                    edges[m].add(t)
    return edges


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer_of(module: str) -> int:
    best, where = "", len(LAYERS)
    for i, room in enumerate(LAYERS):
        for prefix in room:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, where = prefix, i
    return where


def test_the_checker_finds_a_circle_and_an_upward_import():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    assert layer_of("mindio_ttp.faulttime.abort") > layer_of("mindio_ttp.control.rank.processor")
    assert layer_of("mindio_ttp.control") > layer_of("mindio_ttp.control.wire.protocol")


def test_no_module_imports_itself_back_in_a_circle():
    mods = modules("mindio_ttp", "patcher")
    assert circles(imports(mods)) == []


def test_every_import_runs_down_the_layers_or_stays_in_its_room():
    mods = modules("mindio_ttp")
    upward = []
    for m, targets in imports(mods).items():
        for t in targets:
            if layer_of(t) < layer_of(m):
                upward.append(f"{m} -> {t}")
    assert upward == []


def test_every_runtime_module_has_a_room():
    unplaced = [m for m in modules("mindio_ttp") if layer_of(m) == len(LAYERS)
                and m != "mindio_ttp"]
    assert unplaced == []
