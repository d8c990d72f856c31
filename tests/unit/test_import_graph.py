"""The package has no import cycle: the modules of ``megatron/`` and what each imports (at module
level and inside functions, read with ``ast``) form a graph without strongly connected components
of more than one module. A package's ``__init__`` importing its own submodules does not count."""

import ast
import os

from tests.helpers.paths import ROOT

PACKAGE = os.path.join(ROOT, "megatron")


def _module_name(path):
    rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _import_graph():
    paths = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                paths[_module_name(path)] = path
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        edges = set()
        for target in targets:
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name and not target.startswith(name + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph):
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_megatron():
    graph = _import_graph()
    assert len(graph) > 50 and "megatron.core.pipeline_parallel.schedules" in graph
    schedules = graph["megatron.core.pipeline_parallel.schedules"]
    assert "megatron.core.pipeline_parallel.interleaved" in schedules
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
