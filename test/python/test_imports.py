"""The package's import structure: no module imports another that (directly or through
others) imports it back, and no module imports one of ours inside a function, which is
how cycles are usually hidden. Read from the source with ast; nothing is imported."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "horovod_zero"


def _modules():
    """module name -> path, for every .py file of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(name, imported, modules):
    """The module an import statement reaches: `name.imported` when that is a module of
    ours (from pkg import submodule), else `name` itself."""
    sub = f"{name}.{imported}" if imported else None
    return sub if sub in modules else name


def _edges(module, tree, modules):
    """(top-level imports of our modules, imports of ours inside functions)."""
    top, nested = set(), []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [(base, a.name) for a in node.names]
        else:
            continue
        for name, imported in names:
            if not name.startswith("horovod_zero"):
                continue
            target = _target(name, imported, modules)
            if target not in modules:
                continue
            if id(node) in inside:
                nested.append((target, node.lineno))
            elif target != module:
                top.add(target)
    return top, nested


def _graph():
    """(module -> the modules of ours it imports anywhere, module -> those imported inside functions)."""
    modules = _modules()
    graph, nested = {}, {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top, nested[module] = _edges(module, tree, modules)
        graph[module] = top | {t for t, _ in nested[module] if t != module}
    return graph, nested


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph, _ = _graph()
    assert len(graph) > 50, sorted(graph)  # the walk found the package
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_ours_inside_a_function():
    _, nested = _graph()
    found = [f"{m}:{line} imports {t}" for m, imports in sorted(nested.items()) for t, line in imports]
    assert not found, "imports inside functions (move them to the top; break a cycle with a lower layer):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source,expected", [
    ("import horovod_zero.a\n", "import cycle: horovod_zero.a -> horovod_zero.b -> horovod_zero.a"),
    ("from horovod_zero import a\n", "import cycle: horovod_zero.a -> horovod_zero.b -> horovod_zero.a"),
    ("import os\n", None),
])
def test_the_cycle_check_finds_a_cycle(source, expected):
    modules = {"horovod_zero.a": pathlib.Path("a.py"), "horovod_zero.b": pathlib.Path("b.py")}
    graph = {"horovod_zero.a": _edges("horovod_zero.a", ast.parse("from horovod_zero.b import x\n"), modules)[0],
             "horovod_zero.b": _edges("horovod_zero.b", ast.parse(source), modules)[0]}
    cycle = _cycle(graph)
    assert (None if cycle is None else "import cycle: " + " -> ".join(cycle)) == expected


def test_the_nested_check_finds_an_import_in_a_function():
    modules = {"horovod_zero.a": pathlib.Path("a.py"), "horovod_zero.b": pathlib.Path("b.py")}
    tree = ast.parse("def f():\n    from horovod_zero.b import x\n    return x\n")
    assert _edges("horovod_zero.a", tree, modules) == (set(), [("horovod_zero.b", 2)])
