"""The package's imports go one way (STYLE.md rule 1): every `eaglekv` import, at module level
or inside a function, points to a lower layer or inside its own, and no module imports itself
back through others. Read from the source with `ast`, so nothing is imported to check it."""

from __future__ import annotations

import ast
import pathlib

import eaglekv

ROOT = pathlib.Path(eaglekv.__file__).parent
# lowest first; a package may import its own layer (inside itself) and any lower one
LAYERS = [{"errors", "version", "blas_env"}, {"config", "core"}, {"kernels", "memory", "model"},
          {"attention", "sampling"}, {"runner", "cuda_graph"}, {"speculative"}, {"engine", "training", "testing"},
          {"server"}, {"bench"}, {"cli"}, {"eaglekv"}]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def module_name(path: pathlib.Path) -> str:
    parts = ("eaglekv",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    graph = {}
    for f in sorted(ROOT.rglob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "eaglekv":
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "eaglekv"}
        graph[module_name(f)] = found
    return graph


def part(module: str) -> str:
    """The top-level piece a module belongs to: eaglekv.engine.scheduler -> engine."""
    return module.split(".")[1] if "." in module else "eaglekv"


def test_every_piece_has_a_layer():
    pieces = {part(m) for m in imports()}
    assert pieces <= set(LEVEL), f"add {sorted(pieces - set(LEVEL))} to LAYERS"


def test_no_upward_import():
    upward = [f"{a} imports {b}" for a, bs in imports().items() for b in bs
              if LEVEL[part(b)] > LEVEL[part(a)]]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = imports()
    modules = set(graph)

    def target(name: str) -> str | None:   # `from eaglekv.x import y`: the module x (or x.y)
        return name if name in modules else None
    edges = {m: {t for t in map(target, bs) if t and t != m} for m, bs in graph.items()}
    # a package's __init__ re-exports its modules: an edge into it is not one out of them
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for n in edges[m]:
            if m.startswith(n + "."):      # a module importing its own package's __init__
                continue
            if state.get(n) == 1:
                cycle.extend(stack[stack.index(n):] + [n])
                return True
            if state.get(n) is None and visit(n, stack + [n]):
                return True
        state[m] = 2
        return False
    for m in sorted(edges):
        if state.get(m) is None and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


def test_runners_do_not_reach_into_the_engine():
    """The speculative runner and the plain one never import the engine, and nothing under
    speculative/ touches an engine's private members."""
    graph = imports()
    for m in [m for m in graph if m.startswith(("eaglekv.speculative", "eaglekv.runner"))]:
        assert not any(part(b) == "engine" for b in graph[m]), m
    for f in (ROOT / "speculative").rglob("*.py"):
        assert "engine._" not in f.read_text(), f
