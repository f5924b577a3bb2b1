"""The code a reader's install cell installs is the code CI tested (issue 49).

Every chapter's install cell installs ``mini_moe @ git+<repository>@<ref>``, with the ref taken
from ``_config.yml`` (``parse.myst_substitutions.mini_moe_ref``). The ref is a commit: the one the
book's package was last pinned to, by ``make pin``. This script checks, for every chapter:

1. the ref its install cell names resolves to a commit of this repository;
2. every ``mini_moe`` name the chapter's code uses exists in the package at that commit:
   ``from mini_moe... import NAME``, ``import mini_moe...``, attribute chains on the package's
   modules (``bench.soft_moe_expert_costs``), and the keyword arguments of calls to the
   package's functions and classes (``MlpExperts(..., kernel=...)``);
3. every file the chapter names in its code (a string constant that looks like a results file,
   ``"dropless-cpu-2core-epyc.json"``, or an f-string such as ``f"prc_k-digits-{name}-...json"``
   as a pattern) is committed at that commit, under ``mini_moe/results/`` (what the wheel
   installs) or, for the few pages that read the book itself, under ``book/``;
4. the package at that commit (``mini_moe/`` and ``pyproject.toml``) is the package in this
   working tree, byte for byte: so the chapters CI executes run on exactly what a reader installs.

Checks 2 and 3 say *what* a reader would miss; check 4 makes the pin exact. After changing the
package, commit, then ``make pin`` (it writes HEAD into ``_config.yml`` and every install cell)
and commit that.

    python .ci/pin.py check    # make check-pin, part of make test
    python .ci/pin.py pin      # make pin: pin the install cells to HEAD
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebooks import ROOT, _cell_sources, _install_code_cell, chapters  # noqa: E402

PACKAGE = "mini_moe"
#: What the wheel installs and the pin must match exactly.
PINNED_PATHS = ("mini_moe", "pyproject.toml")
INSTALL_LINE = re.compile(r'^MINI_MOE = "mini_moe(?:\[[^\]]*\])? @ git\+(\S+)@(\S+)"$', re.M)
#: A string constant that names a committed file (a results file, a figure, a registration).
FILE_NAME = re.compile(r"^[\w.+-]+\.(?:json|npz|png|md)$")


def git(*args: str, check: bool = True) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True)
    if check and result.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def resolve(ref: str) -> str | None:
    """The commit ``ref`` names in this repository, or None."""
    out = subprocess.run(["git", "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"], cwd=ROOT, text=True,
                         capture_output=True)
    return out.stdout.strip() or None


def install_ref(md_text: str) -> str | None:
    """The git ref that a chapter's install cell installs mini_moe from."""
    cell = _install_code_cell(md_text)
    match = INSTALL_LINE.search(cell.group(1)) if cell else None
    return match.group(2) if match else None


# --- the package at a commit, read with ast (never imported) ------------------------------------

@dataclass
class Module:
    name: str                                        # dotted, e.g. mini_moe.layer
    names: dict[str, ast.AST | tuple[str, str] | None] = field(default_factory=dict)
    # value: a FunctionDef/ClassDef node, ("from", "module.name") for a re-export, None otherwise


class Package:
    """``mini_moe``'s modules and files at one commit."""

    def __init__(self, commit: str):
        self.commit = commit
        self.files = set(git("ls-tree", "-r", "--name-only", commit, "--", PACKAGE, "book").split())
        self._modules: dict[str, Module | None] = {}

    def path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def is_module(self, module: str) -> bool:
        return self.path(module) is not None

    def module(self, module: str) -> Module | None:
        if module not in self._modules:
            path = self.path(module)
            self._modules[module] = None if path is None else self._read(module, path)
        return self._modules[module]

    def _read(self, module: str, path: str) -> Module:
        tree = ast.parse(git("show", f"{self.commit}:{path}"))
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        found = Module(module)
        for node in tree.body:
            targets = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.names[node.name] = node
            elif isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    found.names[alias.asname or alias.name.split(".")[0]] = None
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    source = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                      + ([node.module] if node.module else []))
                for alias in node.names:
                    found.names[alias.asname or alias.name] = ("from", f"{source}.{alias.name}")
            elif isinstance(node, (ast.If, ast.Try)):  # names bound in either branch
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                        found.names.setdefault(inner.name, inner)
                    elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        found.names.setdefault(inner.id, None)
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found.names[name.id] = None
        return found

    def lookup(self, module: str, name: str):
        """What ``module.name`` is: ("module", dotted), ("def", node), ("value", None) or None."""
        if self.is_module(f"{module}.{name}"):
            return ("module", f"{module}.{name}")
        found = self.module(module)
        if found is None or name not in found.names:
            return None
        value = found.names[name]
        seen = set()
        while isinstance(value, tuple) and value not in seen:  # follow re-exports to the definition
            seen.add(value)
            source, attr = value[1].rsplit(".", 1)
            if self.is_module(value[1]):
                return ("module", value[1])
            origin = self.module(source)
            value = origin.names.get(attr) if origin is not None else None
        return ("def", value) if isinstance(value, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
            else ("value", None)


def _parameters(node: ast.AST) -> tuple[set[str], bool] | None:
    """The keyword names a function (a class: its __init__) accepts, and whether it takes **kwargs;
    None when they cannot be read (a dataclass, a class without __init__)."""
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            return None
        node = init
    args = node.args
    names = {a.arg for a in args.args + args.kwonlyargs}
    return names, args.kwarg is not None


# --- a chapter's uses of the package ------------------------------------------------------------

@dataclass
class Use:
    what: str       # "name" | "keyword" | "file"
    text: str       # what the chapter wrote, e.g. "bench.soft_moe_expert_costs"
    line: int       # line in the cell
    cell: int       # code cell number (1-based)


class Uses(ast.NodeVisitor):
    """Walks a chapter's code cells in order, tracking which local names are mini_moe modules."""

    def __init__(self, package: Package):
        self.package = package
        self.aliases: dict[str, str] = {}       # local name -> dotted module
        self.problems: list[Use] = []
        self.cell = 0
        self.shadowed: list[set[str]] = []

    def _alias(self, name: str) -> str | None:
        if any(name in scope for scope in self.shadowed):
            return None
        return self.aliases.get(name)

    def _problem(self, what, text, node):
        self.problems.append(Use(what, text, getattr(node, "lineno", 0), self.cell))

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.split(".")[0] != PACKAGE:
                continue
            if not self.package.is_module(alias.name):
                self._problem("name", f"import {alias.name}", node)
            elif alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases[PACKAGE] = PACKAGE

    def visit_ImportFrom(self, node):
        if node.level or not (node.module or "").split(".")[0] == PACKAGE:
            for alias in node.names:
                self.aliases.pop(alias.asname or alias.name, None)
            return
        for alias in node.names:
            local = alias.asname or alias.name
            found = self.package.lookup(node.module, alias.name)
            if found is None:
                self._problem("name", f"from {node.module} import {alias.name}", node)
                self.aliases.pop(local, None)
            elif found[0] == "module":
                self.aliases[local] = found[1]
            else:
                self.aliases.pop(local, None)

    def _bind(self, target):
        for name in ast.walk(target):
            if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store):
                if self.shadowed:
                    self.shadowed[-1].add(name.id)
                else:
                    self.aliases.pop(name.id, None)

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self._bind(target)
            self.visit(target)

    def visit_For(self, node):
        self.visit(node.iter)
        self._bind(node.target)
        for child in node.body + node.orelse:
            self.visit(child)

    def _scoped(self, node, bound: set[str], body):
        self.shadowed.append(set(bound))
        for name in ast.walk(node):  # every name the function or comprehension binds
            if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store):
                self.shadowed[-1].add(name.id)
        for child in body:
            self.visit(child)
        self.shadowed.pop()

    def visit_FunctionDef(self, node):
        for default in node.args.defaults + node.args.kw_defaults:
            if default is not None:
                self.visit(default)
        args = node.args
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        self._scoped(node, params, node.body)
        self._bind(ast.Name(node.name, ast.Store()))

    def visit_Lambda(self, node):
        self._scoped(node, {a.arg for a in node.args.args}, [node.body])

    def _comprehension(self, node):
        self._scoped(node, set(), node.generators + [getattr(node, "elt", None) or node.key,
                                                      *( [node.value] if isinstance(node, ast.DictComp) else [])])

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def _resolve(self, node) -> tuple[str, str] | None:
        """For a chain ``alias.a.b``: check it and return ("def"/"value"/"module", text) of its end."""
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or self._alias(node.id) is None:
            return None
        module, text = self._alias(node.id), node.id
        for attr in reversed(chain):
            text = f"{text}.{attr}"
            found = self.package.lookup(module, attr)
            if found is None:
                return ("missing", text)
            if found[0] != "module":
                return (found[0], text, found[1])
            module = found[1]
        return ("module", text)

    def visit_Attribute(self, node):
        found = self._resolve(node)
        if found is None:
            self.generic_visit(node)
        elif found[0] == "missing":
            self._problem("name", found[1], node)

    def visit_Call(self, node):
        target = self._resolve(node.func) if isinstance(node.func, ast.Attribute) else None
        if isinstance(node.func, ast.Name):
            target = None
        if target and target[0] == "def":
            accepted = _parameters(target[2])
            if accepted is not None and not accepted[1]:
                for keyword in node.keywords:
                    if keyword.arg is not None and keyword.arg not in accepted[0]:
                        self._problem("keyword", f"{target[1]}(..., {keyword.arg}=...)", node)
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, str) and FILE_NAME.match(node.value) and not self._committed(node.value):
            self._problem("file", node.value, node)

    def visit_JoinedStr(self, node):
        pattern = "".join(part.value if isinstance(part, ast.Constant) else "*" for part in node.values)
        if FILE_NAME.match(pattern.replace("*", "x")) and "*" in pattern and not self._committed(pattern):
            self._problem("file", f'f"{pattern}"', node)
        for part in node.values:
            if isinstance(part, ast.FormattedValue):
                self.visit(part.value)

    def _committed(self, name: str) -> bool:
        where = [f"{PACKAGE}/results/{name}", f"{PACKAGE}/results/*/{name}", f"book/{name}"]
        return any(fnmatch.fnmatchcase(path, pattern) for path in self.package.files for pattern in where)

    def chapter(self, md_text: str) -> list[Use]:
        for source in _cell_sources(md_text):
            self.cell += 1
            self.visit(ast.parse(source))
        return self.problems


def chapter_problems(md_text: str, package: Package) -> list[Use]:
    """What a chapter uses that the package at ``package.commit`` does not have."""
    return Uses(package).chapter(md_text)


def package_drift(commit: str) -> list[str]:
    """The files of the package that differ between ``commit`` and this working tree."""
    changed = git("diff", "--name-only", commit, "--", *PINNED_PATHS).split()
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *PINNED_PATHS).split()
    return sorted(set(changed) | set(untracked))


def check() -> list[str]:
    problems, packages = [], {}
    for md in chapters():
        rel = md.relative_to(ROOT).as_posix() if md.is_relative_to(ROOT) else str(md)
        text = md.read_text()
        ref = install_ref(text)
        if ref is None:
            problems.append(f"{rel}: its install cell names no `mini_moe @ git+...@REF`: run `make sync`")
            continue
        commit = resolve(ref)
        if commit is None:
            problems.append(f"{rel}: its install cell installs mini_moe at {ref!r}, which names no commit of this "
                            "repository (a shallow clone? `git fetch --unshallow`; else `make pin`)")
            continue
        if commit not in packages:
            packages[commit] = Package(commit)
        for use in chapter_problems(text, packages[commit]):
            kind = {"name": "uses", "keyword": "passes", "file": "reads"}[use.what]
            problems.append(f"{rel}, code cell {use.cell} line {use.line}: {kind} {use.text}, which mini_moe at "
                            f"{ref[:12]} (the commit its install cell installs) does not have")
    for commit in packages:
        drift = package_drift(commit)
        if drift:
            shown = ", ".join(drift[:8]) + (f" and {len(drift) - 8} more" if len(drift) > 8 else "")
            problems.append(f"the install cells install mini_moe at {commit[:12]}, but this checkout's package "
                            f"differs from it in {shown}: what CI tests is not what a reader installs. Commit the "
                            "package, run `make pin` and commit the install cells")
    if len(packages) > 1:
        problems.append(f"the chapters install {len(packages)} different commits: run `make pin`")
    return problems


def pin() -> str:
    """Write HEAD into _config.yml's mini_moe_ref (the caller then runs `make sync`)."""
    drift = package_drift("HEAD")
    if drift:
        raise SystemExit(f"pin: commit the package first; uncommitted: {', '.join(drift)}")
    head = git("rev-parse", "HEAD").strip()
    config = ROOT / "_config.yml"
    text, n = re.subn(r"^(\s*mini_moe_ref:\s*)\S+", rf"\g<1>{head}", config.read_text(), count=1, flags=re.M)
    if n != 1:
        raise SystemExit("pin: _config.yml has no parse.myst_substitutions.mini_moe_ref line")
    config.write_text(text)
    assert yaml.safe_load(text)["parse"]["myst_substitutions"]["mini_moe_ref"] == head
    return head


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "pin"])
    args = parser.parse_args(argv)
    if args.command == "pin":
        print(f"pin: _config.yml's mini_moe_ref is now {pin()}; `make sync` writes it into every install cell")
        return 0
    problems = check()
    for problem in problems:
        print("pin:", problem, file=sys.stderr)
    if not problems:
        refs = {install_ref(md.read_text()) for md in chapters()}
        print(f"pin: {len(chapters())} chapters install mini_moe at {', '.join(sorted(refs))}, which has every "
              "name and file they use and equals this checkout's package")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
