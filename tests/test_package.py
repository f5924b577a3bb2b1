"""The package's structure: its import graph has no cycles, and its docstring maps every module."""

import ast
import pathlib

import mini_moe

PACKAGE = pathlib.Path(mini_moe.__file__).parent


def imports_of(path: pathlib.Path) -> set[str]:
    """The mini_moe modules a file imports, at top level or inside functions."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mini_moe":
            if node.module == "mini_moe":  # from mini_moe import routers, ...: modules (or __init__ names)
                deps |= {a.name for a in node.names if (PACKAGE / f"{a.name}.py").exists()} or {"__init__"}
            else:
                deps.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mini_moe.")}
    return deps - {path.stem}


def test_no_module_imports_a_module_that_imports_it():
    graph = {path.stem: imports_of(path) for path in PACKAGE.glob("*.py")}
    for sub in (p for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p.name != "results"):
        # a subpackage (mini_moe.routers) is one node: the union of its files' imports, less itself
        graph[sub.name] = set().union(*(imports_of(f) for f in sub.glob("*.py"))) - {sub.name, "__init__"}
    assert graph["parallel"] >= {"layer"} and "model" not in graph["parallel"]  # the cycle this test guards
    done, active = set(), []

    def visit(module):  # depth-first search; a module met again on the active path closes a cycle
        assert module not in active, f"import cycle: {' -> '.join(active[active.index(module):] + [module])}"
        if module in done:
            return
        active.append(module)
        for dep in sorted(graph.get(module, ())):
            visit(dep)
        active.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_package_docstring_lists_every_module():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    missing = [m for m in sorted(modules) if f":mod:`mini_moe.{m}`" not in mini_moe.__doc__]
    assert not missing, f"mini_moe's docstring does not describe: {missing}"
