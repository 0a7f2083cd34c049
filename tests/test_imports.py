"""The package's import graph: no cycles, and the library never imports the tools above it.

Edges come from every ``import`` statement in the source (function-level ones too), resolved to
``pisa_attn`` modules; importing a submodule does not count as importing its package's face.
Tools are ``pisa_attn.bench`` (demo, kernel bench, study, generate), ``pisa_attn.cli`` and
``pisa_attn.__main__``; everything else is the library.
"""

import ast
import functools
from pathlib import Path

import pisa_attn

ROOT = Path(pisa_attn.__file__).resolve().parent
TOOLS = ("pisa_attn.bench", "pisa_attn.cli", "pisa_attn.__main__")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("pisa_attn", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the pisa_attn modules its source imports."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:  # `import pisa_attn.x.y` names the deepest module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


def test_graph_is_read():
    g = import_graph()
    assert "pisa_attn.attention" in g["pisa_attn"]  # the face re-exports the entry point
    assert "pisa_attn.ops.reference" in g["pisa_attn.attention"]


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_library_does_not_import_tools():
    up = sorted((m, t) for m, ts in import_graph().items() if not _is_tool(m) for t in ts if _is_tool(t))
    assert up == []
