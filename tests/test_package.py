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


def _inner_imports(path: pathlib.Path, package: str) -> set[str]:
    """The sibling modules of ``mini_moe.<package>`` that a file imports, type-checking imports included."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"mini_moe.{package}."):
            deps.add(node.module.split(".")[2])
        elif isinstance(node, ast.ImportFrom) and node.module == f"mini_moe.{package}":
            deps |= {a.name for a in node.names if (PACKAGE / package / f"{a.name}.py").exists()}
    return deps - {path.stem}


def test_no_cycle_between_the_files_of_a_subpackage():
    """routers/controls.py once imported routers/registry.py (for a type hint) while registry.py
    imported controls.py: a circle the module-level test above cannot see."""
    for package in ("routers", "labs"):
        graph = {p.stem: _inner_imports(p, package) for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__"}
        for module, deps in graph.items():
            for dep in deps:
                assert module not in graph.get(dep, ()), f"mini_moe.{package}: {module} <-> {dep}"
        done = set()

        def visit(module, active):
            assert module not in active, f"mini_moe.{package}: cycle {' -> '.join(active + [module])}"
            if module not in done:
                for dep in sorted(graph.get(module, ())):
                    visit(dep, active + [module])
                done.add(module)

        for module in sorted(graph):
            visit(module, [])


def test_the_registry_declares_each_routers_options():
    """`RouterSpec.options` is the one place that reads a router's options (the layer, the
    configuration and diagnose ask it); checked against hand-written expectations."""
    from mini_moe import routers

    token = routers.spec("softmax_token_choice").options
    assert {"k", "capacity_factor", "z_loss", "balance_loss"} <= set(token) and token["k"] == 1
    assert "capacity_factor" in routers.spec("softmax_expert_choice").options
    assert "slots_per_expert" in routers.spec("soft_moe").options
    assert "null_experts" in routers.spec("adamoe").options and "null_experts" not in token
    for name in routers.ROUTERS:
        assert not {"dim", "num_experts", "rngs"} & set(routers.spec(name).options), name
